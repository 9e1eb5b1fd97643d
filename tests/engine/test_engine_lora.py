"""LoRA semantics, reference policy, EMA, LR schedule, non-finite skips and diffusers exports."""

import pytest
import tinymodel as tm
import torch

from flowgrpo.engine import EMA, DiffusersFSDPEngine
from flowgrpo.engine.ema import local
from flowgrpo.engine.engine import LRLambda
from flowgrpo.errors import TrainingDiverged


def _velocity(adapter, transformer, traj, step=0):
    with torch.no_grad():
        return adapter.forward(
            transformer,
            traj.latents[:, step],
            traj.sigmas[:, step],
            traj.prompt_embeds,
            height=traj.height,
            width=traj.width,
            guidance_scale=1.0,
        )


@pytest.fixture(scope="module")
def trained(dist1, tiny_traj):
    adapter = tm.TinyAdapter()
    engine = tm.engine_for(adapter, tm.make_config("lora"))
    for _ in range(2):
        tm.train_step(engine, tiny_traj, tm.ADVANTAGES)
    return adapter, engine


def test_only_lora_params_change(trained):
    _, engine = trained
    base = tm.TinyAdapter().transformer.state_dict()
    after = engine.full_state_dict()
    lora = {k: v for k, v in after.items() if ".lora_" in k}
    assert len(lora) == 2 * 6 * 2 - 2  # A and B x 6 targets x 2 blocks (no to_add_out last)
    zero = sorted(k for k, v in lora.items() if "lora_B" in k and v.abs().max() == 0)
    # the last block discards its context queries: add_q_proj gets no gradient there
    assert zero == ["transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"]
    rest = {k.replace(".base_layer.", "."): v for k, v in after.items() if ".lora_" not in k}
    assert rest.keys() == base.keys()
    assert max((rest[k] - base[k]).abs().max().item() for k in base) == 0.0
    assert all(("lora_" in n) == p.requires_grad for n, p in engine.model.named_parameters())


def test_disabled_adapter_forward_equals_base(trained, tiny_traj):
    adapter, engine = trained
    base = tm.TinyAdapter()
    want = _velocity(base, base.transformer, tiny_traj)
    with engine.reference_transformer() as ref:
        got = _velocity(adapter, ref, tiny_traj)
    policy = _velocity(adapter, engine.transformer, tiny_traj)
    print(f"disabled-adapter vs base: {(got - want).abs().max():.2e}")
    assert (got - want).abs().max() < 1e-6
    assert (policy - want).abs().max() > 1e-4  # the adapter is back on and matters


def test_ema_weights_swap_in_and_out(trained, tiny_traj):
    adapter, engine = trained
    before = _velocity(adapter, engine.transformer, tiny_traj)
    params = tm.trainable(engine)
    with engine.ema_weights():
        ema = _velocity(adapter, engine.transformer, tiny_traj)
        swapped = tm.trainable(engine)
    assert (ema - before).abs().max() > 1e-6
    for k, e in zip(engine.param_names, tm.ema_values(engine), strict=True):
        assert torch.equal(swapped[k], e)
    after = _velocity(adapter, engine.transformer, tiny_traj)
    assert torch.equal(after, before)
    assert all(torch.equal(params[k], v) for k, v in tm.trainable(engine).items())


def test_ema_schedule_matches_reference():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([p], decay=0.9, update_every=2)
    expected = torch.zeros(3)
    for step in range(6):
        with torch.no_grad():
            p.add_(1.0)
        applied = ema.update(step)
        assert applied == (step % 2 == 1)
        if applied:
            d = min((1 + step) / (10 + step), 0.9)
            expected = d * expected + (1 - d) * p.detach()
        torch.testing.assert_close(ema.shadow[0], expected)
    assert ema.decay_at(100) == 0.9


def test_lr_schedules():
    cos = LRLambda("cosine", warmup_steps=2, total_steps=10)
    assert [cos(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert cos(6) == pytest.approx(0.5)
    assert cos(10) == pytest.approx(0.0) and cos(50) == pytest.approx(0.0)
    const = LRLambda("constant", warmup_steps=4, total_steps=10)
    assert [const(s) for s in (0, 3, 9)] == [0.25, 1.0, 1.0]
    assert LRLambda("cosine", 0, 0)(7) == 1.0  # unknown total -> constant


def test_non_finite_loss_skips_and_then_raises(dist1, tiny_traj):
    traj = tiny_traj.select([0, 1])
    cfg = tm.make_config(
        "clip", **{"optim.max_consecutive_skips": 2}, **{"update.micro_batch_size": 2}
    )
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    before = tm.trainable(engine)
    metrics = tm.train_step(engine, traj, torch.tensor([float("nan"), 1.0]))
    assert metrics["skipped"] == 1.0 and metrics["optimizer_steps"] == 0.0
    assert engine.optimizer_steps == 0 and engine.consecutive_skips == 1
    after = tm.trainable(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in engine.params)
    assert not engine.optimizer.state  # AdamW never stepped
    with pytest.raises(TrainingDiverged, match="2 consecutive non-finite updates"):
        tm.train_step(engine, traj, torch.tensor([1.0, float("inf")]) * 0 + float("nan"))


def test_update_that_would_overflow_is_never_applied(dist1, tiny_traj, tmp_path):
    """Finite loss and gradients, but lr 1e39 overflows fp32 in AdamW's update (torch's own
    step would fail with "value cannot be converted to type float without overflow"): the
    step is skipped before it touches anything, and after max_consecutive_skips the run stops
    with one line naming the cause."""
    cfg = tm.make_config("lora", **{"optim.max_consecutive_skips": 2})
    cfg.optim.lr, cfg.optim.lr_schedule = 1e39, "constant"
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    before = tm.trainable(engine)
    metrics = tm.train_step(engine, tiny_traj, tm.ADVANTAGES)
    assert metrics["skipped"] == 1.0 and torch.isfinite(torch.tensor(metrics["loss"]))
    after = tm.trainable(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not engine.optimizer.state and engine.optimizer_steps == 0
    with pytest.raises(TrainingDiverged, match=r"lower optim.lr \(now 1e\+39\)"):
        tm.train_step(engine, tiny_traj, tm.ADVANTAGES)


def test_update_check_sees_moment_overflow_and_checkpoints_refuse_non_finite(
    dist1, tiny_traj, tmp_path
):
    """A finite but huge gradient (max_grad_norm off) overflows AdamW's second moment: the
    dry run says no, while a blind step would store inf in the optimizer state. Weights that
    are not finite are never checkpointed."""
    from flowgrpo.engine import save_checkpoint

    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora"))
    for k in range(tiny_traj.num_train_steps):
        tm.flow_grpo(engine).step_loss(tiny_traj, tm.ADVANTAGES, k)[0].backward()
    assert engine._update_is_finite()
    local(engine.params[0].grad).fill_(1e21)  # finite; (1 - beta2) times its square is not
    assert not engine._update_is_finite()
    engine.optimizer.step()  # what the check prevents
    state = engine.optimizer.state[engine.params[0]]
    assert not bool(torch.isfinite(local(state["exp_avg_sq"])).all())
    with torch.no_grad():
        local(engine.params[1]).fill_(float("nan"))
    assert not engine.weights_are_finite()
    with pytest.raises(TrainingDiverged, match="non-finite weights"):
        save_checkpoint(engine, tmp_path / "ckpt", 1)
    assert not (tmp_path / "ckpt" / "step_1").exists()


def test_config_errors_name_the_field(dist1):
    from flowgrpo.engine import EngineConfig, OptimConfig

    with pytest.raises(ValueError, match="lr_schedule"):
        EngineConfig(optim=OptimConfig(lr_schedule="linear")).validate()
    with pytest.raises(ValueError, match="advantages"):
        engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("clip"))
        tm.train_step(engine, tm.make_trajectory(tm.TinyAdapter()), torch.zeros(3))


def _sd3_inputs(adapter):
    g = torch.Generator().manual_seed(1)
    h, w = 32, 48
    x = adapter.prepare_latents(2, h, w, g)
    embeds, neg = adapter.encode(["a red cat", "a blue dog"], guidance_scale=2.0)
    return dict(
        latents=x,
        sigma=torch.tensor([0.8, 0.35]),
        embeds=embeds,
        negative_embeds=neg,
        guidance_scale=2.0,
        height=h,
        width=w,
    )


def test_lora_export_and_full_export_load_in_diffusers(dist1, tmp_path):
    from diffusers import SD3Transformer2DModel

    from flowgrpo.engine import EngineConfig, LoraConfig
    from flowgrpo.models.sd3 import SD3Adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    adapter = SD3Adapter(tiny_pipeline("sd3"))
    engine = DiffusersFSDPEngine(adapter, EngineConfig(lora=LoraConfig(rank=4, alpha=8)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a "trained" LoRA with a visible effect
        for n, p in engine.model.named_parameters():
            if "lora_B" in n:
                local(p).copy_(0.05 * torch.randn(local(p).shape, generator=g))
    inputs = _sd3_inputs(adapter)
    with torch.no_grad():
        v_engine = adapter.velocity(engine.transformer, **inputs)
        base = tiny_pipeline("sd3")
        v_base = SD3Adapter(base).velocity(base.transformer, **inputs)

    file = engine.export_lora(tmp_path / "lora")
    assert file.name == "pytorch_lora_weights.safetensors" and file.is_file()
    fresh = tiny_pipeline("sd3")
    fresh.load_lora_weights(tmp_path / "lora")
    with torch.no_grad():
        v_lora = SD3Adapter(fresh).velocity(fresh.transformer, **inputs)

    engine.save_full(tmp_path / "full")
    full = SD3Transformer2DModel.from_pretrained(tmp_path / "full")
    with torch.no_grad():
        v_full = SD3Adapter(fresh).velocity(full, **inputs)

    d_lora, d_full = (v_lora - v_engine).abs().max(), (v_full - v_engine).abs().max()
    print(
        f"export: lora {d_lora:.2e}, full {d_full:.2e}, lora effect {(v_engine - v_base).abs().max():.2e}"
    )
    assert (v_engine - v_base).abs().max() > 1e-2
    assert d_lora < 1e-5
    assert d_full < 1e-5


def test_bf16_compute_keeps_fp32_master_weights_and_output(dist1, tiny_traj):
    adapter = tm.TinyAdapter()
    engine = tm.engine_for(adapter, tm.make_config("clip", **{"fsdp.param_dtype": "bf16"}))
    metrics = tm.train_step(engine, tiny_traj.select([0, 1]), tm.ADVANTAGES[:2])
    assert metrics["skipped"] == 0.0
    assert {p.dtype for p in engine.params} == {torch.float32}
    v = _velocity(adapter, engine.transformer, tiny_traj)
    base = tm.TinyAdapter()
    want = _velocity(base, base.transformer, tiny_traj)
    assert v.dtype == torch.float32
    assert 1e-5 < (v - want).abs().max() < 0.1  # bf16 rounding, not garbage


def test_zero_advantage_samples_are_dropped(dist1, tiny_traj):
    """skip_zero_advantage: training on 4 samples of which 2 have advantage 0 is training on
    the other 2 alone (mean over kept samples, KL included); all zero -> no update at all."""
    adv = torch.tensor([1.0, 0.0, -0.5, 0.0])
    kept = [0, 2]
    runs = {
        "skip": (tiny_traj, adv, {}),
        "kept_only": (tiny_traj.select(kept), adv[kept], {}),
        "no_skip": (tiny_traj, adv, {"flow_grpo.skip_zero_advantage": False}),
    }
    params, metrics = {}, {}
    for name, (traj, a, over) in runs.items():
        engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora", **over))
        metrics[name] = tm.train_step(engine, traj, a)
        params[name] = tm.trainable(engine)
    diff = max((params["skip"][k] - params["kept_only"][k]).abs().max() for k in params["skip"])
    assert diff < 1e-6
    assert metrics["skip"]["samples_trained"] == 2 and metrics["skip"]["samples_dropped"] == 2
    assert metrics["no_skip"]["samples_trained"] == 4
    # keeping them dilutes the policy gradient and adds their KL: a different update
    moved = max((params["skip"][k] - params["no_skip"][k]).abs().max() for k in params["skip"])
    assert moved > 1e-4
    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora"))
    before = tm.trainable(engine)
    m = tm.train_step(engine, tiny_traj, torch.zeros(4))
    assert m["optimizer_steps"] == 0 and m["samples_trained"] == 0 and engine.optimizer_steps == 0
    after = tm.trainable(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
