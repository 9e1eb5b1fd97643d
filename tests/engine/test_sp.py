"""Ulysses sequence parallelism (flowgrpo.engine.sp) on gloo: sp=2 against one process for the
tiny pipelines of the core cost tier's image families that run under SP (Qwen-Image, FLUX,
SD3) and of the other families whose adapters write their own plan (forward, guided
velocity, LoRA + FSDP2 gradients through both CFG branches, activation checkpointing, text
padding, the clear errors), and a 4-rank dp2 x sp2 / HSDP case. One spawn per world size runs
every check (imports cost seconds per process); the ranks compute their own single-process
references (tests/engine/sp_ranks.py).
"""

import pytest
import sp_ranks
import torch

from flowgrpo.testing.ranks import spawn

pytestmark = pytest.mark.slow  # spawns 2 and 4 ranks
TOL = 1e-5


@pytest.fixture(scope="module")
def sp2(tmp_path_factory):
    work = tmp_path_factory.mktemp("sp2")
    spawn(sp_ranks.sp_job, 2, str(work))
    return torch.load(work / "sp2.pt", weights_only=False)


@pytest.fixture(scope="module")
def dp2sp2(tmp_path_factory):
    work = tmp_path_factory.mktemp("dp2sp2")
    spawn(sp_ranks.dp_sp_job, 4, str(work))
    return torch.load(work / "dp2sp2.pt", weights_only=False)


def _kind(sp2, kind):
    res = sp2[kind]
    assert "crash" not in res, res.get("crash")
    return res


def test_mesh_layout(sp2):
    assert sp2["meshes"] == [
        dict(dp_rank=0, dp_size=1, sp_rank=r, sp_size=2, fsdp=2) for r in range(2)
    ]


@pytest.mark.parametrize("kind", sp_ranks.KINDS)
def test_forward_and_guided_velocity_equal_one_process(sp2, kind):
    res = _kind(sp2, kind)
    print(kind, {k: f"{v:.1e}" for k, v in res.items() if k.endswith("_rel")})
    assert res["family"] == kind
    assert res["forward_rel"] < TOL
    assert res["velocity_rel"] < TOL  # CFG doubled batch (Qwen: masks of different lengths)


@pytest.mark.parametrize("kind", sp_ranks.KINDS)
def test_bf16_velocity_is_as_close_to_fp32_as_one_process(sp2, kind):
    res = _kind(sp2, kind)
    assert res["bf16_family"] == kind  # enabled with the adapter's spec, passed explicitly
    sp, one = res["bf16_sp_vs_fp32_rel"], res["bf16_one_vs_fp32_rel"]
    print(f"{kind} bf16: sp {sp:.1e}, one process {one:.1e}, apart {res['bf16_sp_vs_one_rel']:.1e}")
    assert sp <= 1.5 * one + 1e-3


@pytest.mark.parametrize("kind", sp_ranks.KINDS)
@pytest.mark.parametrize("case", ["lora_fsdp", "lora_fsdp_ckpt", "pad_lora_fsdp"])
def test_lora_fsdp_gradients_equal_one_process(sp2, kind, case):
    res = _kind(sp2, kind)
    print(
        f"{kind} {case}: grads rel {res[f'{case}_grad_rel']:.1e}, scale {res[f'{case}_grad_ratio']}"
    )
    assert res[f"{case}_n_grads"] > 0
    assert res[f"{case}_block0_calls"] == (2 if case.endswith("ckpt") else 1)  # one CFG batch
    assert res[f"{case}_grad_rel"] < TOL
    assert res[f"{case}_grad_ratio"] == pytest.approx(1.0, abs=1e-5)  # not 1/sp


@pytest.mark.parametrize("kind", sp_ranks.OWN_KINDS)
def test_own_plan_forward_velocity_and_grads_equal_one_process(sp2, kind):
    """Z-Image, Qwen-Image 2.1, HunyuanVideo-1.5: the plans and processors in their files."""
    res = _kind(sp2, kind)
    print(kind, {k: f"{v:.1e}" for k, v in res.items() if k.endswith("_rel")})
    assert res["family"] == res["bf16_family"] == kind
    assert res["forward_rel"] < TOL
    assert res["velocity_rel"] < TOL
    assert res["bf16_sp_vs_fp32_rel"] <= 1.5 * res["bf16_one_vs_fp32_rel"] + 1e-3
    for case in ("lora_fsdp", "lora_fsdp_ckpt"):
        assert res[f"{case}_n_grads"] > 0
        assert res[f"{case}_grad_rel"] < TOL, case
        assert res[f"{case}_grad_ratio"] == pytest.approx(1.0, abs=1e-5)  # not 1/sp
    assert res["lora_fsdp_ckpt_block0_calls"] == 2 * res["lora_fsdp_block0_calls"] > 0


def test_without_the_gradient_scale_fsdp_gives_grad_over_sp(sp2):
    assert _kind(sp2, "sd3")["no_scale_grad_ratio"] == pytest.approx(0.5, abs=1e-5)


@pytest.mark.parametrize("kind", sp_ranks.KINDS)
def test_text_not_divisible_by_sp_is_padded(sp2, kind):
    res = _kind(sp2, kind)
    assert res["pad_text_len"] % 2 == 1
    assert res["pad_forward_rel"] < TOL
    assert res["pad_velocity_rel"] < TOL


@pytest.mark.parametrize("kind", sp_ranks.KINDS)
def test_image_tokens_not_divisible_by_sp_is_a_clear_error(sp2, kind):
    err = _kind(sp2, kind)["odd_image_error"]
    assert err.startswith("ValueError: 99 image tokens do not split over sp_degree=2"), err


def test_non_cp_processor_is_refused(sp2):
    err = _kind(sp2, "sd3")["stock_processor_error"]
    assert err.startswith(
        "RuntimeError: attention module 'transformer_blocks.1.attn' uses "
        "JointAttnProcessor2_0, which does not take part"
    ), err


def test_lora_after_sp_is_refused(sp2):
    err = _kind(sp2, "flux")["lora_after_sp_error"]
    assert err.startswith("RuntimeError: 'proj_out' was replaced after enable_sequence_parallel")


def test_different_inputs_in_an_sp_group_are_detected(sp2):
    err = _kind(sp2, "qwen_image")["mismatch_error"]
    assert err.startswith("RuntimeError: the ranks of an SP group got different inputs"), err


def test_heads_not_divisible_by_sp_is_a_clear_error(sp2):
    assert "has 3 attention heads, which do not split over sp_degree=2" in sp2["heads_error"]


@pytest.mark.parametrize("layout", ["dp2sp2", "hsdp2sp2"])
def test_four_ranks_dp2_sp2(dp2sp2, layout):
    for rank, res in enumerate(dp2sp2):
        got = res[layout]
        print(f"{layout} rank {rank}: grads rel {got['grad_rel']:.1e}, scale {got['grad_ratio']}")
        assert (got["dp_rank"], got["sp_rank"], got["dp_size"]) == (rank // 2, rank % 2, 2)
        assert got["grad_rel"] < TOL
        assert got["grad_ratio"] == pytest.approx(1.0, abs=1e-5)


def test_mesh_arguments_are_checked():
    from flowgrpo.engine.sp import build_parallel_mesh

    with pytest.raises(ValueError, match="divisible by replicate_degree 1 x sp_degree 4"):
        build_parallel_mesh(6, 1, 4, "cpu")
    with pytest.raises(ValueError, match="both >= 1"):
        build_parallel_mesh(2, 1, 0, "cpu")


def test_one_process_mesh_is_the_plain_fsdp_mesh(dist1):
    from flowgrpo.engine import build_parallel_mesh

    pm = build_parallel_mesh(1)
    assert pm.cp is None and pm.fsdp.mesh_dim_names == ("shard",)
    assert (pm.dp_rank, pm.dp_size, pm.sp_rank, pm.sp_size) == (0, 1, 0, 1)
