"""STAND-IN for ``sgl_kernel``, not the real package.

The real ``sgl_kernel`` (PyPI ``sglang-kernel``) holds SGLang's compiled kernels, its CPU ops
among them, and is published only as CUDA builds (no sdist), so it cannot be installed on a
machine with no GPU. SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1 --device cpu``) imports the
eight functions below at module level, so the server does not even import without them. All
eight serve speculative decoding only: SGLang calls them when ``--speculative-algorithm`` is
set (the KV-copy pool and the draft-tree ops), never when it serves a model plainly, which is
all this stand-in is for. So each one stands in for the real CPU op's name and raises
``NotImplementedError`` if it is ever called, rather than compute something unchecked.

It registers no ``torch.ops.sgl_kernel`` ops on purpose: SGLang probes that namespace
(``convert_weight_packed`` and others) to pick its Intel AMX kernels, and with none there it
takes its plain-torch paths (``--attention-backend torch_native``).

Installed by ``scripts/install-sglang-cpu.sh`` as the distribution ``sgl-kernel-cpu-standin``.
"""

__version__ = "0.1.0"  # the version in pyproject.toml: a stand-in's, not sglang-kernel's

_WHY = (
    "is a stand-in of sgl_kernel (scripts/sgl_kernel_cpu): the real CPU op is in the "
    "CUDA-only sglang-kernel wheel. SGLang calls it only for speculative decoding, which "
    "this CPU install does not support."
)


def _unsupported(name: str):
    raise NotImplementedError(f"sgl_kernel.{name} {_WHY}")


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Stand-in for the real CPU op of the same name, which, for every K and V buffer of every
    layer (given as raw data pointers and per-buffer row strides in bytes), copies the token
    rows at ``src_loc`` to ``tgt_loc``. SGLang's KV pool calls it to move accepted draft
    tokens' KV in speculative decoding (``enable_kv_cache_copy``). Raises NotImplementedError."""
    _unsupported("copy_all_layer_kv_cache_cpu")


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Stand-in for the real CPU op of the same name, which writes each request's slice of
    ``out_cache_loc`` into its row of ``req_to_token`` at ``[start_offset, end_offset)``.
    SGLang calls it when allocating KV slots for speculative decoding
    (``alloc_for_spec_decode``). Raises NotImplementedError."""
    _unsupported("assign_req_to_token_pool_cpu")


def build_tree_kernel_efficient_cpu(*args, **kwargs):
    """Stand-in for the real CPU op of the same name, which builds EAGLE's draft token tree
    (tree mask, positions and the retrieve index/next-token/next-sibling links) from the
    drafter's top-k choices. Speculative decoding only. Raises NotImplementedError."""
    _unsupported("build_tree_kernel_efficient_cpu")


def verify_tree_greedy_cpu(*args, **kwargs):
    """Stand-in for the real CPU op of the same name, which walks the draft tree against the
    target model's greedy predictions and fills the accepted tokens and their count per
    request. Speculative decoding only. Raises NotImplementedError."""
    _unsupported("verify_tree_greedy_cpu")


def assign_draft_cache_locs_contiguous_cpu(*args, **kwargs):
    """Stand-in for the real CPU op of the same name, which gives the drafter's tokens
    contiguous KV slots per request in ``req_to_token``. Speculative decoding only.
    Raises NotImplementedError."""
    _unsupported("assign_draft_cache_locs_contiguous_cpu")


def assign_extend_cache_locs_cpu(*args, **kwargs):
    """Stand-in for the real CPU op of the same name, which reads the KV slots of each
    request's ``[start_offset, end_offset)`` from ``req_to_token`` into one flat
    ``out_cache_loc``. Speculative decoding only. Raises NotImplementedError."""
    _unsupported("assign_extend_cache_locs_cpu")


def fill_accept_out_cache_loc_cpu(*args, **kwargs):
    """Stand-in for the real CPU op of the same name, which gathers the KV slots of the
    accepted draft tokens (``accept_index`` into ``out_cache_loc``). Speculative decoding
    only. Raises NotImplementedError."""
    _unsupported("fill_accept_out_cache_loc_cpu")


def fill_bonus_tokens_cpu(*args, **kwargs):
    """Stand-in for the real CPU op of the same name, which picks each request's last
    accepted token (the bonus token) out of ``accept_tokens`` by ``accept_lens``.
    Speculative decoding only. Raises NotImplementedError."""
    _unsupported("fill_bonus_tokens_cpu")
