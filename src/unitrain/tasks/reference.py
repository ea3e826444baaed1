"""The reference policy of a KL term (GRPO, PPO) and of DPO: the policy the run started from."""

from __future__ import annotations

from unitrain import lora
from unitrain import step as step_lib


class Reference:
    """The starting parameters, copied before the first update donates them (in pinned host memory
    with ref_params_host_offload); with LoRA the live base with its adapters off (no copy)."""

    def __init__(self, run):
        cfg = run.cfg
        self.lora = bool(cfg.lora_rank)
        self.frozen = None if self.lora else step_lib.frozen_copy(run.init_params, cfg.ref_params_host_offload)
        # Where a program brings the reference's arrays (device memory, also when they are kept on the host).
        self.device = step_lib.device_shardings(self.of(run.init_params))

    def of(self, params) -> dict:
        """The reference's parameters beside the policy's `params`."""
        return lora.adapters_off(params) if self.lora else self.frozen
