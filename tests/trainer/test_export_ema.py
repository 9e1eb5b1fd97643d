"""``export-lora`` of a run whose EMA has never been updated says so (its EMA weights are the
initial ones: every lora_B exactly 0, the export changes nothing), and exports are normal
files (0644 under umask 022; safetensors writes 0600)."""

from __future__ import annotations

import os
import stat

import pytest
from safetensors.torch import load_file

from flowgrpo.config import load_config
from flowgrpo.testing.models import random_toy_path

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = [
    f"model.path={random_toy_path()}",
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=4",
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.save_every=2",
    "run.progress_bar=false",
    "lora.enabled=true",
    "lora.rank=4",
    "lora.alpha=8",
    "optim.lr=3e-2",
    "flow_grpo.kl_beta=0",
    "ema.enabled=true",
]


def _lora_b(file) -> list:
    return [t for k, t in load_file(str(file)).items() if "lora_B" in k]


def test_an_export_of_a_never_updated_ema_warns_and_exports_are_readable(tmp_path, capsys):
    from flowgrpo.trainer.loop import run_export_lora, run_training

    out = tmp_path / "run"
    run_training(load_config("toy-digits", [*SMALL, "ema.update_every=8", f"run.output_dir={out}"]))
    capsys.readouterr()
    cfg = load_config("toy-digits", [*SMALL, "ema.update_every=8"], command="export")
    ema = run_export_lora(cfg, out, tmp_path / "ema")
    err = capsys.readouterr().err
    assert "the EMA has not been updated yet (2 optimizer steps, ema.update_every=8)" in err
    assert "--raw exports the trained weights" in err
    assert all(float(b.abs().max()) == 0 for b in _lora_b(ema))  # the no-op export it warns of
    raw = run_export_lora(cfg, out, tmp_path / "raw", raw=True)
    assert "warning" not in capsys.readouterr().err
    assert max(float(b.abs().max()) for b in _lora_b(raw)) > 0
    full = run_export_lora(cfg, out, tmp_path / "full", full=True)
    mask = os.umask(0)
    os.umask(mask)
    files = [ema, raw, *[p for p in full.rglob("*") if p.is_file()]]
    assert len(files) > 3
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f

    updated = tmp_path / "updated"  # the EMA updated at step 2: no warning
    run_training(
        load_config("toy-digits", [*SMALL, "ema.update_every=2", f"run.output_dir={updated}"])
    )
    capsys.readouterr()
    cfg = load_config("toy-digits", [*SMALL, "ema.update_every=2"], command="export")
    file = run_export_lora(cfg, updated, tmp_path / "ema2")
    assert "warning" not in capsys.readouterr().err
    assert max(float(b.abs().max()) for b in _lora_b(file)) > 0
