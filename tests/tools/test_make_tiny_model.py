"""tools/make_tiny_model.py's --help: the defaults, and the head sizes vLLM's CPU build serves."""

import pytest

from make_tiny_model import main


def test_help_shows_every_default_and_the_head_sizes_vllm_serves(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--head-dim HEAD_DIM 16 suits the tests; sampler=vllm on vLLM's CPU build needs one of 32, 64," in text
    for default in ("(default: llama)", "(default: 512)", "(default: 64)", "(default: 16)", "(default: 0.02)"):
        assert default in text
