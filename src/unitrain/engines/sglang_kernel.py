"""A pure-torch stand-in for the one sgl_kernel CPU function SGLang's scheduler imports on a CPU
(`from sgl_kernel import assign_req_to_token_pool_cpu`, sglang/srt/mem_cache/allocation.py): the
package index ships sgl_kernel's CUDA build alone, which does not register it.

Not imported by unitrain: `sampler: sglang` (engines/sglang.py) starts its CPU server with a folder
first on PYTHONPATH that holds this file as `sitecustomize.py`, so every Python process of that
server runs it at its start and nothing else does. It hooks the import of `sgl_kernel`: the CUDA
build's package runs as it would, and where it fails (on a host without CUDA's driver it cannot load
its ops library) the module keeps what it defined before, with the stand-in, and any other CPU op
imported from it refused when called (speculative decoding's: unused here).
"""

import importlib.abc
import importlib.util
import sys

MODULE = "sgl_kernel"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Writes each request's new KV-cache slots into its row of the request-to-token table:
    req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th run of out_cache_loc
    (the runs laid end to end in request order). `pool_len` is the table's row length (the kernel's
    stride), which indexing the table already knows."""
    import torch

    lengths = (end_offset - start_offset).long()
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths  # where each request's run starts in out_cache_loc
    rows = torch.repeat_interleave(req_pool_indices.long(), lengths, output_size=total)
    shift = torch.repeat_interleave(start_offset.long() - first, lengths, output_size=total)
    columns = torch.arange(total, device=req_to_token.device) + shift
    req_to_token[rows, columns] = out_cache_loc[:total].to(req_to_token.dtype)


def _refused(name: str):
    """Another CPU op of sgl_kernel that SGLang's modules import on a CPU (speculative decoding's, the
    KV-cache moves of draft and state pools): imported, and refused if ever called."""

    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel's {name} is not in unitrain's CPU stand-in (engines/sglang_kernel.py): SGLang calls it "
            "for features sampler sglang does not use (speculative decoding, KV-cache moves)"
        )

    return op


def _missing(name: str):
    """The failed package's module __getattr__: its CPU ops (`*_cpu`) refused when called, nothing else."""
    if name.endswith("_cpu"):
        return _refused(name)
    raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds sgl_kernel as the other finders do, and loads it with the stand-in added."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            self.loader.exec_module(module)
        except ImportError:  # its CUDA ops library: none of it serves the CPU engine
            module.__getattr__ = _missing
        module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu


if __name__ == "sitecustomize":  # the server's processes; imported as unitrain's module it hooks nothing
    sys.meta_path.insert(0, _Finder())
