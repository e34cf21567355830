"""ZeRO++ in one process: blockwise quantization and its error bound, the options' construction
checks, node arithmetic of the process mesh, and one-process runs (multi-process bytes, loss and
checkpoints: ``integration/test_zeropp_runtime.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.errors import ConfigError
from shardckpt.format.layout import Mesh
from shardckpt.runtime import MixedPrecisionPolicy, ShardedSGD, ZeroEngine, ZeroPP
from shardckpt.runtime.zeropp import quant
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh, _env_ranks_per_node

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)


# ------------------------------------------------------------------------------ quantization


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), s=st.integers(1, 40).map(lambda n: 2 * n),
       block=st.sampled_from([1, 3, 16, 256]), bits=st.sampled_from(quant.BITS),
       scale=st.floats(1e-6, 1e4), seed=st.integers(0, 2**16))
def test_round_trip_within_half_a_step(rows: int, s: int, block: int, bits: int, scale: float,
                                       seed: int) -> None:
    x = torch.randn(rows, s, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, : s // 3] = 0  # a block of zeros has scale 0 and comes back as zeros
    packed = quant.quantize(x, bits, block, kernel="eager")  # the fused kernels: below
    assert packed.dtype == torch.uint8 and packed.shape == (rows, quant.packed_size(s, bits, block))
    back = quant.dequantize(packed, s, bits, block, kernel="eager")
    err = (back - x).abs()
    assert (err <= quant.error_bound(x, bits, block)).all()
    # the bound is half a step: absmax / 254 (int8), absmax / 14 (int4), plus fp32 rounding
    amax = x.abs().max()
    assert float(err.max()) <= float(amax) * (1 / (2 * quant.qmax(bits)) + 2.0 ** -21)
    assert (back[x == 0] == 0).all()


def test_wire_format_integers_then_scales() -> None:
    x = torch.tensor([[127.0, -63.5, 0.0, 1.0, 2.0, -4.0]])
    p = quant.quantize(x, 8, 4)  # blocks [127, -63.5, 0, 1] (scale 1) and [2, -4] (scale 4/127)
    assert p[0, :6].view(torch.int8).tolist() == [127, -64, 0, 1, 64, -127]
    assert p[0, 6:].clone().view(torch.float32).tolist() == pytest.approx([1.0, 4 / 127])
    p4 = quant.quantize(torch.tensor([[7.0, -7.0, 1.0, 0.0]]), 4, 4)
    assert p4[0, :2].tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | (8 << 4)]


# The fused kernels against the reference, bit for bit. Block 16 and the four (bits, dtype) pairs
# only: each (kind, bits, block, dtype) is a kernel of its own, compiled on first use.
PAIRS = [(8, torch.bfloat16), (8, torch.float32), (4, torch.float32), (4, torch.bfloat16)]


def _fused_and_reference(x: torch.Tensor, bits: int, block: int) -> None:
    s = x.shape[1]
    ref = quant.quantize(x, bits, block, kernel="eager")
    got = quant.quantize(x, bits, block, kernel="fused")
    assert torch.equal(got, ref), (x.shape, (got != ref).nonzero()[:8].tolist())
    want = quant.dequantize(ref, s, bits, block, x.dtype, kernel="eager")
    back = quant.dequantize(ref, s, bits, block, x.dtype, kernel="fused")
    assert back.dtype == x.dtype and torch.equal(back, want), x.shape
    out = torch.full_like(x, float("nan"))  # written in place, every element
    assert quant.dequantize(ref, s, bits, block, x.dtype, out=out, kernel="fused") is out
    assert torch.equal(out, want)


@settings(max_examples=40, deadline=None)
@given(pair=st.sampled_from(PAIRS), rows=st.integers(2, 4), s=st.integers(17, 100).map(lambda n: 2 * n),
       scale=st.sampled_from([1e-30, 1e-6, 1.0, 3e4, 1e30]), zero_rows=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fused_kernels_write_the_reference_bytes(pair, rows: int, s: int, scale: float,
                                                 zero_rows: bool, seed: int) -> None:
    """Several rows of several blocks, the last block of a row ragged or whole (``s`` from 34 to
    200, block 16), blocks of zeros, tiny and huge magnitudes (subnormal scales included)."""
    bits, dtype = pair
    x = torch.randn(rows, s, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, : s // 3] = 0
    if zero_rows:
        x[-1] = 0
    _fused_and_reference(x.to(dtype), bits, 16)


@pytest.mark.parametrize("bits,dtype", [(8, torch.bfloat16), (4, torch.float32)])
def test_fused_kernels_compile_once_per_shape_class(bits: int, dtype: torch.dtype) -> None:
    """qwZ's (int8, bf16) and qgZ's (int4, fp32) kernels: a graph per shape class at most (one
    row or several; one block or several; the last block ragged or whole; a single pair of
    elements), compiled on first use; after that no row length or row count recompiles."""
    from shardckpt.runtime.zeropp import fused

    gen = torch.Generator().manual_seed(bits)
    first = [(rows, s) for rows in (1, 3) for s in (2, 10, 16, 24, 32)]  # every class, once
    again = [(2, 12), (4, 6), (1, 34), (1, 160), (1, 202), (2, 36), (4, 64), (3, 130), (5, 4),
             (2, 2), (1, 1000), (6, 1024), (1, 8), (5, 16)]                 # ragged and whole
    for rows, s in first:
        _fused_and_reference(torch.randn(rows, s, generator=gen).to(dtype), bits, 16)
    kernels = [fused.compiled(k, bits, 16, d, o) for k, d, o in
               [("quantize", dtype, None), ("dequantize", torch.uint8, dtype)]]
    assert all(1 <= k.compiles <= len(first) for k in kernels), [k.compiles for k in kernels]
    before = fused.compilations()
    for rows, s in again:
        _fused_and_reference(torch.randn(rows, s, generator=gen).to(dtype), bits, 16)
    assert fused.compilations() == before


def test_fused_non_finite_blocks_as_the_reference() -> None:
    """Non-finite inputs are not supported (:mod:`quant`): the block holding one gets a non-finite
    scale in both implementations; every other block's bytes are the reference's."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    x[0, 5], x[1, 40] = float("inf"), float("nan")
    for bits, dtype in PAIRS:
        xd = x.to(dtype)
        ref = quant.quantize(xd, bits, 16, kernel="eager")
        got = quant.quantize(xd, bits, 16, kernel="fused")
        pb = quant.payload_size(64, bits)
        scales = [p[:, pb:].clone().view(torch.float32) for p in (ref, got)]
        assert torch.equal(scales[0].isfinite(), scales[1].isfinite())
        assert scales[1].isfinite().sum() == 6 and torch.equal(scales[0][0, 1:], scales[1][0, 1:])
        per = 16 * bits // 8  # payload bytes per block
        for row, bad in ((0, 0), (1, 2)):
            keep = [b for b in range(4) if b != bad]
            for b in keep:
                assert torch.equal(ref[row, b * per:(b + 1) * per], got[row, b * per:(b + 1) * per])


def test_the_kernel_is_chosen_by_argument_or_environment(monkeypatch) -> None:
    assert quant.kernel_choice() == "fused"
    monkeypatch.setenv(quant.KERNEL_ENV, "eager")
    assert quant.kernel_choice() == "eager" and quant.kernel_choice("fused") == "fused"
    monkeypatch.setenv(quant.KERNEL_ENV, "triton")
    with pytest.raises(ConfigError, match="SHARDCKPT_ZEROPP_KERNEL='triton'"):
        quant.quantize(torch.ones(1, 4), 8, 4)
    with pytest.raises(ConfigError, match="kernel='cuda'.*fused or eager"):
        quant.kernel_choice("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("bits,dtype", PAIRS)
def test_fused_kernels_within_the_bound_on_cuda(bits: int, dtype: torch.dtype) -> None:
    """On a GPU (Triton) the bytes may differ from the CPU reference's in a rounding; every value
    stays within :func:`quant.error_bound`, ragged rows and blocks of zeros included."""
    gen = torch.Generator(device="cuda").manual_seed(bits)
    for rows, s in [(1, 2), (3, 98), (1, 4098), (8, 1 << 16)]:
        x = (torch.randn(rows, s, device="cuda", generator=gen) * 3).to(dtype)
        x[0, : s // 3] = 0
        packed = quant.quantize(x, bits, 256, kernel="fused")
        assert packed.shape == (rows, quant.packed_size(s, bits, 256))
        back = quant.dequantize(packed, s, bits, 256, torch.float32, kernel="fused")
        assert ((back - x.float()).abs() <= quant.error_bound(x, bits, 256)).all()
        assert (back[0, : s // 3] == 0).all()
        ref = quant.dequantize(packed, s, bits, 256, torch.float32, kernel="eager")
        assert torch.equal(back, ref)  # same bytes, same values: the dequantize is exact


def test_a_kernel_that_does_not_compile_falls_back_to_the_reference(monkeypatch, caplog) -> None:
    """No C++ compiler for inductor, say: one warning, the reference's bytes, and the reference
    from then on."""
    from torch._dynamo.exc import BackendCompilerFailed

    from shardckpt.runtime.zeropp import fused

    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise BackendCompilerFailed(broken, RuntimeError("no working C++ compiler"), None)

    monkeypatch.setattr(fused, "quantize", broken)
    monkeypatch.setattr(fused, "dequantize", broken)
    monkeypatch.setattr(quant, "_FUSED_FAILED", [])
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING", logger="shardckpt.runtime.zeropp.quant"):
        packed = quant.quantize(x, 8, 16)
    assert torch.equal(packed, quant.quantize_reference(x, 8, 16))
    assert "no working C++ compiler" in caplog.text and "SHARDCKPT_ZEROPP_KERNEL" in caplog.text
    assert quant.kernel_choice() == "eager" and len(calls) == 1
    back = quant.dequantize(packed, 40, 8, 16)
    assert torch.equal(back, quant.dequantize_reference(packed, 40, 8, 16)) and len(calls) == 1


def test_bf16_rows_dequantize_into_the_compute_dtype() -> None:
    x = torch.randn(2, 32).to(torch.bfloat16)
    back = quant.dequantize(quant.quantize(x, 8, 16), 32, 8, 16, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == (2, 32)


# ------------------------------------------------------------------------ construction checks


@pytest.mark.parametrize("kwargs,needle", [
    (dict(qwz=True, block_size=0), "block_size is 0"),
    (dict(qwz=True, block_size=-8), "block_size is -8"),
    (dict(qwz=True, block_size=2.5), "block_size is 2.5"),
    (dict(qwz=True, block_size=True), "block_size is True"),
    (dict(qgz=True, grad_bits=2), "grad_bits is 2"),
    (dict(qgz=True, grad_bits=16), "grad_bits is 16"),
    (dict(qgz=True, grad_bits=4.0), "grad_bits is 4.0"),
    (dict(qwz="yes"), "qwz='yes'"),
])
def test_bad_options_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ZeroPP(**kwargs)


def _engine(pm: ProcessMesh | None = None, **kwargs):
    torch.manual_seed(0)
    return ZeroEngine(LlamaForCausalLM(LlamaConfig(**TINY)), policy=LLAMA_POLICY,
                      process_mesh=pm or ProcessMesh.single(), **kwargs)


def _unlaunched(world: int, ranks_per_node: int | None, replicate: int = 1) -> ProcessMesh:
    """A mesh of ``world`` ranks seen from rank 0 without a backend: construction checks run
    before anything would call ``torch.distributed``."""
    return ProcessMesh(Mesh.for_world(world, replicate), 0, torch.device("cpu"),
                       ranks_per_node=ranks_per_node)


@pytest.mark.parametrize("pm,kwargs,needle", [
    (None, dict(stage=2, zeropp=ZeroPP(hpz=True)), "hpz needs stage 3"),
    (None, dict(stage=1, zeropp=ZeroPP(hpz=True)), "engine is stage 1"),
    ((6, 4), dict(zeropp=ZeroPP(hpz=True)), "world size (6) to be a multiple of the node size"),
    ((6, 4), dict(zeropp=ZeroPP(qgz=True)), "ranks_per_node=4"),
    (None, dict(zeropp=ZeroPP(qgz=True),
                mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)),
     "reduce in another dtype: model.u0000.float32 (bfloat16)"),
    (None, dict(zeropp=ZeroPP(qgz=True), mixed_precision=MixedPrecisionPolicy(torch.bfloat16,
                                                                              None)),
     "reduce_dtype=torch.float32"),
    ((4, 2, 2), dict(zeropp=ZeroPP(qwz=True)), "HSDP"),
    (None, dict(zeropp={"qwz": True}), "pass ZeroPP"),
])
def test_engine_refuses_what_zeropp_cannot_do(pm, kwargs: dict, needle: str) -> None:
    mesh = None if pm is None else _unlaunched(*pm)
    with pytest.raises(ConfigError) as info:
        _engine(mesh, **kwargs)
    assert needle in str(info.value)


def test_the_options_that_work_on_the_same_meshes() -> None:
    """The checks refuse only what they name: qwZ at stage 2, qgZ with an fp32 reduce."""
    _engine(stage=2, zeropp=ZeroPP(qwz=True, qgz=True))
    _engine(zeropp=ZeroPP(qgz=True, grad_bits=8),
            mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32))


def test_ranks_per_node() -> None:
    pm = _unlaunched(8, 4)
    assert (pm.node_size, pm.node_of(5), pm.node_rank) == (4, 1, 0)
    assert pm.spans_nodes([3, 4]) and not pm.spans_nodes([4, 7]) and pm.world_spans_nodes
    assert not _unlaunched(8, None).world_spans_nodes
    with pytest.raises(ConfigError, match="ranks_per_node is 0"):
        _unlaunched(8, 0)
    assert _env_ranks_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert _env_ranks_per_node({"LOCAL_WORLD_SIZE": "x"}) is None
    assert _env_ranks_per_node({}) is None


# ------------------------------------------------------------------------------ one process


def _run(zeropp: ZeroPP | None, steps: int = 3) -> tuple[list[float], ZeroEngine]:
    engine = _engine(deterministic=True, zeropp=zeropp)
    opt = ShardedSGD(engine, [{"params": [p for _, p in engine.named_parameters()]}], lr=0.5)
    losses = []
    for i in range(steps):
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, engine


def test_one_process_runs() -> None:
    """hpZ and qgZ on one rank move nothing and change no bit; qwZ computes with the
    dequantized weights (its losses differ) but leaves the fp32 masters untouched by
    quantization; the hpZ copy is held from forward to backward and dropped after."""
    plain, _ = _run(None)
    assert _run(ZeroPP(hpz=True))[0] == plain
    assert _run(ZeroPP(qgz=True))[0] == plain
    qwz, engine = _run(ZeroPP(qwz=True))
    assert qwz != plain and max(abs(a - b) for a, b in zip(qwz, plain)) < 1e-2
    hpz = _engine(zeropp=ZeroPP(hpz=True))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = causal_lm_loss(hpz(tokens), tokens)
    blocks = [g for g in hpz.groups.values() if g.spec.unit]
    assert all(g.secondary is not None for g in blocks)
    assert hpz.accounting.secondary_bytes == sum(g.spec.padded_numel * 4 for g in blocks)
    loss.backward()
    assert all(g.secondary is None for g in hpz.groups.values())
    assert hpz.accounting.secondary_bytes == 0
    with torch.no_grad():  # no backward follows: nothing is kept
        hpz(tokens)
    assert all(g.secondary is None for g in hpz.groups.values())
