"""The quantized frozen base (``model.base_quant``, issue 37 §2): the codes against an
independent transcription of bitsandbytes' formats (and bitsandbytes itself where installed),
quantizing a shard of rows = the rows of the whole, 2 ranks = 1 with sharded loading, resume
bit-exact, exports, the text encoders, and the config errors. The on-policy check (|log r| = 0
at the rollout's split) is in test_engine_bf16.py."""

from __future__ import annotations

import math

import pytest
import quant_ranks
import tinymodel as tm
import torch
from torch import nn

from flowgrpo.engine.quant import NF4_BLOCK, QuantLinear, dequantize, quantize, quantize_frozen
from flowgrpo.testing.ranks import spawn

# the NF4 codebook as QLoRA's paper prints it (Dettmers et al. 2023, appendix E), to 4 places
NF4_PAPER = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
             0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]  # fmt: skip


def _reference_nf4(w: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Element by element: each row in blocks of 64 (the last one short), each value divided
    by its block's absmax and given the index of the nearest code (ties to the lower one)."""
    from flowgrpo.engine.quant import NF4_CODE

    codes, scales = [], []
    for row in w.double().tolist():
        row_codes, row_scales = [], []
        for start in range(0, len(row), NF4_BLOCK):
            block = row[start : start + NF4_BLOCK]
            absmax = max(abs(v) for v in block)
            row_scales.append(absmax)
            for v in block:
                x = max(-1.0, min(1.0, v / absmax)) if absmax else 0.0
                row_codes.append(min(range(16), key=lambda i: (abs(x - NF4_CODE[i]), i)))
        codes.append(row_codes)
        scales.append(row_scales)
    return codes, scales


def _unpack(packed: torch.Tensor, cols: int) -> list[list[int]]:
    return [[b >> 4 if i % 2 == 0 else b & 15 for i, b in enumerate(
        v for byte in row for v in (byte, byte))][:cols] for row in packed.tolist()]  # fmt: skip


def test_nf4_codebook_is_qlora_s():
    from flowgrpo.engine.quant import NF4_CODE

    assert [round(c, 4) for c in NF4_CODE] == NF4_PAPER


@pytest.mark.parametrize("cols", [128, 100])
def test_nf4_codes_match_the_elementwise_reference(cols):
    """Codes and scales of a weight with a zero row, a constant block and (cols=100) a short
    last block equal the element-by-element reference; the dequantized weight is within half
    the widest code gap of each block's absmax."""
    w = torch.randn(6, cols, generator=torch.Generator().manual_seed(0)) * 0.02
    w[2] = 0
    w[3, :64] = 0.5
    codes, scale = quantize(w, "nf4")
    assert codes.dtype == torch.uint8 and codes.shape == (6, math.ceil(cols / 64) * 32)
    want_codes, want_scales = _reference_nf4(w)
    assert _unpack(codes, cols) == want_codes
    assert scale.tolist() == want_scales
    deq = dequantize(codes, scale, "nf4", cols, torch.float32)
    bound = scale.repeat_interleave(64, dim=1)[:, :cols] * (1 - 0.6962) / 2
    assert ((deq - w).abs() <= bound + 1e-9).all()
    assert torch.equal(deq[2], torch.zeros(cols)) and torch.equal(deq[3, :64], w[3, :64])


def test_int8_codes_match_the_rowwise_reference():
    w = torch.randn(5, 70, generator=torch.Generator().manual_seed(1))
    codes, scale = quantize(w, "int8")
    absmax = w.abs().max(dim=1).values
    want = [
        [round(127 * v / a) for v in row] for row, a in zip(w.double().tolist(), absmax.tolist())
    ]
    assert codes.dtype == torch.int8 and codes.tolist() == want
    assert torch.equal(scale[:, 0], absmax)
    deq = dequantize(codes, scale, "int8", 70, torch.float32)
    assert ((deq - w).abs() <= absmax[:, None] / 254 * 1.0001).all()


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_codes_equal_bitsandbytes(mode):
    """Bit for bit bitsandbytes' own quantizers (quantize_4bit nf4 with fp32 absmax;
    int8_vectorwise_quant) and its NF4 dequantizer, where it is installed."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(48, 192, generator=torch.Generator().manual_seed(2)) * 0.05
    codes, scale = quantize(w, mode)
    if mode == "nf4":
        q, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
        assert torch.equal(codes.reshape(-1), q.reshape(-1))
        assert torch.equal(scale.reshape(-1), state.absmax)
        assert torch.equal(
            dequantize(codes, scale, mode, 192, torch.float32), bnb.dequantize_4bit(q, state)
        )
    else:
        q, row_stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(w.clone())
        assert torch.equal(codes, q) and torch.equal(scale[:, 0], row_stats)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_a_shard_of_rows_quantizes_as_the_whole(mode):
    """What sharded loading relies on: rows [a, b) quantize to rows [a, b) of the whole."""
    w = torch.randn(11, 200, generator=torch.Generator().manual_seed(3))
    codes, scale = quantize(w, mode)
    for a, b in ((0, 6), (6, 11), (3, 4)):
        part = quantize(w[a:b], mode)
        assert torch.equal(part[0], codes[a:b]) and torch.equal(part[1], scale[a:b])


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_quant_linear_forward_and_input_grad(mode):
    """QuantLinear = F.linear with the dequantized weight (bitwise), and its input gradient is
    that weight's (the codes are saved, not the weight); the base gets no gradient."""
    lin = nn.Linear(96, 24).requires_grad_(False)
    q = QuantLinear.from_linear(lin, mode)
    x = torch.randn(3, 5, 96, requires_grad=True)
    w = dequantize(q.weight_q, q.weight_scale, mode, 96, torch.float32)
    assert torch.equal(q(x), nn.functional.linear(x, w, lin.bias))
    grad = torch.randn(3, 5, 24)
    (gx,) = torch.autograd.grad(q(x), x, grad)
    assert torch.allclose(gx, grad @ w, rtol=1e-6, atol=1e-7)
    assert not any(p.requires_grad for p in q.parameters())
    assert torch.equal(q.weight, w)


def test_quantize_frozen_skips_what_trains_and_fp32_modules():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    model._keep_in_fp32_modules = ["2"]
    assert quantize_frozen(model, "int8") == 1
    assert isinstance(model[0], QuantLinear) and type(model[1]) is nn.Linear
    assert type(model[2][0]) is nn.Linear
    assert quantize_frozen(model, "none") == 0


@pytest.fixture(scope="module")
def quant_runs(tmp_path_factory, dist1):
    """The 2-rank job (spawned) and the same runs in this process."""
    from load_ranks import save

    work = tmp_path_factory.mktemp("quant_ranks")
    save("sd3", work)
    ctx = spawn(quant_ranks.job, 2, str(work), join=False)
    try:
        single = {m: quant_ranks.run(work / "sd3", m, empty=False) for m in quant_ranks.MODES}
    finally:
        while not ctx.join():
            pass
    sharded = torch.load(work / "quant.pt", weights_only=False)
    assert "error" not in sharded, sharded.get("error")
    return sharded, single


@pytest.mark.slow  # spawns 2 ranks
@pytest.mark.parametrize("mode", quant_ranks.MODES)
def test_two_ranks_equal_one_with_sharded_loading(quant_runs, mode):
    """On 2 ranks the meta-built base, each rank quantizing its rows as they load, equals the
    whole-model path bit for bit (codes, scales, LoRA; before and after a step) and holds
    about half the codes per rank; and 2 ranks equal 1 process: the codes bit for bit, the
    trained LoRA to 1e-6."""
    from load_ranks import differences

    sharded, single = quant_runs
    two = sharded[mode]
    assert differences(two[True]["loaded"], two[False]["loaded"]) == []
    assert differences(two[True]["trained"], two[False]["trained"]) == []
    one = single[mode]
    codes = [k for k in one["loaded"] if k.endswith((".weight_q", ".weight_scale"))]
    assert len(codes) > 20
    for k in codes:
        assert torch.equal(two[True]["loaded"][k], one["loaded"][k]), k
    lora = [k for k in one["trained"] if "lora_" in k and k.startswith("model.")]
    assert lora
    for k in lora:
        diff = (two[True]["trained"][k].float() - one["trained"][k].float()).abs().max()
        assert diff <= 1e-6, (k, float(diff))
    assert any(not torch.equal(two[True]["trained"][k], two[True]["loaded"][k]) for k in lora)
    (whole, count), ranks = one["local_bytes"], two["bytes"]
    assert sum(r[0] for r in ranks) == whole and all(r[1] == count for r in ranks)
    assert all(0.4 * whole <= r[0] <= 0.6 * whole for r in ranks)
    per_param = {"int8": 1.0, "nf4": 0.5625}[mode]
    assert per_param <= whole / count <= per_param * 1.1


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_resume_is_bit_exact(dist1, tiny_traj, tmp_path, mode):
    """Saved after 2 steps, loaded into a fresh engine (the base quantized again from the
    weights), 2 more steps == 4 uninterrupted steps, bit for bit."""
    from flowgrpo.engine import load_checkpoint

    over = {"base_quant": mode}
    want = tm.run_case("lora", tiny_traj, tm.ADVANTAGES, 4, ckpt=tmp_path, save_at=2,
                       snapshots=(4,), **over)  # fmt: skip
    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora", **over))
    assert any(isinstance(m, QuantLinear) for m in engine.model.modules())
    load_checkpoint(engine, tmp_path)
    for _ in range(2):
        tm.train_step(engine, tiny_traj, tm.ADVANTAGES)
    got = tm.trainable(engine)
    assert got.keys() == want["params@4"].keys()
    for k, v in got.items():
        assert torch.equal(v, want["params@4"][k]), k


def test_quantized_base_changes_the_policy_a_little(dist1, tiny_traj):
    """Not vacuous: the quantized base's velocity differs from the bf16 base's (by the
    quantization error, small against the velocity itself)."""
    from flowgrpo.rollout import trajectory_log_prob

    means = {}
    for mode in ("none", "int8", "nf4"):
        engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora", base_quant=mode))
        with torch.no_grad():
            out = trajectory_log_prob(engine.adapter, engine.model, tiny_traj, 0)
        means[mode] = out.prev_sample_mean
    scale = means["none"].abs().mean()
    for mode, most in (("int8", 0.02), ("nf4", 0.2)):
        diff = (means[mode] - means["none"]).abs().mean() / scale
        assert 0 < diff < most, (mode, float(diff))


def test_export_lora_says_the_base_was_quantized_and_full_export_dequantizes(dist1, tmp_path):
    """export_lora's file carries the note; save_full writes the dequantized base with the LoRA
    merged: a fresh transformer loaded from it gives the engine's output."""
    from safetensors import safe_open

    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora", base_quant="nf4"))
    with torch.no_grad():
        for p in engine.params:  # a LoRA that is not zero
            p.add_(0.01)
    file = engine.export_lora(tmp_path / "lora")
    with safe_open(str(file), framework="pt") as f:
        assert f.metadata()["flowgrpo_trained_on_base_quant"] == "nf4"
        assert all("lora" in k for k in f.keys())
    path = engine.save_full(tmp_path / "full")
    fresh = engine.model_class.from_pretrained(path)
    assert not any(isinstance(m, QuantLinear) for m in fresh.modules())
    adapter = engine.adapter
    x = adapter.prepare_latents(1, 16, 16, torch.Generator().manual_seed(0))
    pos, neg = adapter.encode(["a"], guidance_scale=1.0)
    kw = dict(guidance_scale=1.0, height=16, width=16)
    with torch.no_grad():
        got = adapter.velocity(fresh, x, torch.tensor([0.7]), pos, neg, **kw)
        want = adapter.velocity(engine.model, x, torch.tensor([0.7]), pos, neg, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_text_encoders_quantized_and_deterministic():
    """``quantize_text_encoders`` replaces the encoders' Linear layers: the embeddings move
    (by the quantization error) and are the same on every build."""
    from flowgrpo.engine.quant import quantize_text_encoders
    from flowgrpo.models.sd3 import SD3Adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    embeds = []
    for mode in ("none", "int8", "int8"):
        pipe = tiny_pipeline("sd3")
        n = quantize_text_encoders(pipe, mode)
        assert (n > 0) == (mode != "none")
        with torch.no_grad():
            pos, _ = SD3Adapter(pipe, max_sequence_length=8).encode(["a cat"], guidance_scale=1.0)
        embeds.append(pos.embeds)
    assert torch.equal(embeds[1], embeds[2]) and not torch.equal(embeds[0], embeds[1])
    assert (embeds[1] - embeds[0]).abs().max() < 0.05 * embeds[0].abs().max()


def test_full_fine_tune_with_a_quantized_base_is_one_config_error():
    from flowgrpo.config import load_config
    from flowgrpo.settings import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.base_quant=int8"], check_paths=False)
    msg = str(err.value)
    assert "model.base_quant" in msg and "lora.enabled" in msg and "\n" not in msg
    cfg = load_config(None, ["model.base_quant=nf4", "lora.enabled=true"], check_paths=False)
    assert cfg.model.base_quant == "nf4"


def test_engine_refuses_a_quantized_base_without_lora(dist1):
    with pytest.raises(ValueError, match="model.base_quant=int8 needs lora.enabled=true"):
        tm.engine_for(tm.TinyAdapter(), tm.make_config("full", base_quant="int8"))
