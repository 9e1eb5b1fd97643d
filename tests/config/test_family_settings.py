"""A family declares its own settings in its adapter file (issue 35): one config section per
family, named as it, from the registry; the old ``model.*`` keys still read (command line,
YAML files and their overlays, a run's recorded config); a setting of another family than the
loaded one is refused; each shipped preset says in its YAML which pipelines and model config
sets it is made for, and that is not a setting."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flowgrpo.config import load_config
from flowgrpo.config.checks import adapter_kwargs, check_model_run, option_keys
from flowgrpo.config.loader import MOVED, config_to_dict, valid_keys
from flowgrpo.config.record import check_resume, checkpoint_record
from flowgrpo.config.schema import Config, ModelConfig
from flowgrpo.config.shipped import list_presets, preset_models, preset_pipelines
from flowgrpo.models import registry
from flowgrpo.settings import ConfigError, setting

RECORDS = Path(__file__).parent / "records"
#: a valid value of each moved key (its default would not show that it was read)
VALUES = {
    "model.true_cfg_scale": 2.0,
    "model.guidance_scale_2": 3.0,
    "model.cfg_normalization": 1.5,
    "model.cfg_truncation": 0.9,
    "model.source_size": 64,
}


def _get(cfg: Config, key: str):
    section, leaf = key.split(".")
    return getattr(getattr(cfg, section), leaf)


def test_each_family_section_is_its_adapter_files_dataclass():
    sections = registry.family_settings()
    assert sections, "some family declares settings"
    fields = {f.name: f for f in dataclasses.fields(Config)}
    names = list(fields)
    for family, settings in sections.items():
        assert family in registry.families()  # named as a registered family
        pipelines = registry.families()[family]
        adapter = registry.import_adapter(registry.SUPPORTED_PIPELINES[pipelines[0]])
        assert settings.__module__ == adapter.__module__  # declared in the adapter's file
        assert isinstance(getattr(Config(), family), settings)
        assert names.index(family) > names.index("model")  # beside the model section
        for f in dataclasses.fields(settings):
            assert f.metadata["help"] and f"{family}.{f.name}" in valid_keys()
            # the adapter takes it, and its keyword's default is the setting's
            param = inspect.signature(adapter.__init__).parameters[f.name]
            assert param.default == getattr(settings(), f.name), (family, f.name)
            assert f.name not in {g.name for g in dataclasses.fields(ModelConfig)}
    for old, new in MOVED.items():  # every moved key has its new home, and left model
        assert new in valid_keys() and old not in valid_keys()


def test_a_new_family_gets_its_section_from_its_registry_line(monkeypatch):
    module = types.ModuleType("flowgrpo.models.newfam")

    @dataclasses.dataclass
    class NewSettings:
        knob: int = setting(3, "A knob of the new family.")

    class NewAdapter:
        settings_class = NewSettings

        def __init__(self, pipe, *, knob: int = 3):
            pass

    NewSettings.__module__ = NewAdapter.__module__ = module.__name__
    module.NewAdapter = NewAdapter
    monkeypatch.setitem(sys.modules, module.__name__, module)
    line = {"NewPipeline": f"{module.__name__}:NewAdapter"}
    monkeypatch.setattr(registry, "SUPPORTED_PIPELINES", {**registry.SUPPORTED_PIPELINES, **line})
    assert registry.family_settings()["newfam"] is NewSettings
    assert "newfam" not in {f.name for f in dataclasses.fields(Config)}  # built at import


def test_a_subclass_in_another_family_does_not_claim_its_parents_settings():
    sections = registry.family_settings()
    from flowgrpo.models.flux import FluxSettings
    from flowgrpo.models.flux_kontext import FluxKontextAdapter, FluxKontextSettings

    assert issubclass(
        FluxKontextAdapter, registry.import_adapter("flowgrpo.models.flux:FluxAdapter")
    )
    assert sections["flux"] is FluxSettings and sections["flux_kontext"] is FluxKontextSettings
    # Kontext's true CFG is FLUX.1's: one key, flux.true_cfg_scale
    assert option_keys()["true_cfg_scale"] == "flux.true_cfg_scale"


def test_new_keys_are_set_and_checked():
    cfg = load_config(
        None, ["flux.true_cfg_scale=2", "zimage.cfg_truncation=0.5"], check_paths=False
    )
    assert (cfg.flux.true_cfg_scale, cfg.zimage.cfg_truncation) == (2.0, 0.5)
    for bad, match in (
        ("flux.true_cfg_scale=0.5", "'flux.true_cfg_scale' must be >= 1"),
        ("zimage.cfg_normalization=-1", "'zimage.cfg_normalization' must be >= 0"),
        ("wan.guidance_scale_2=-1", "'wan.guidance_scale_2' must be >= 0"),
        ("flux_kontext.source_size=0", "'flux_kontext.source_size' must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad], check_paths=False)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_key_on_the_command_line_sets_the_new_one(old):
    cfg = load_config(None, [f"{old}={VALUES[old]}"], check_paths=False)
    assert _get(cfg, MOVED[old]) == VALUES[old]
    section, leaf = old.split(".")
    assert leaf not in config_to_dict(cfg)[section]  # written back in the new form only
    from flowgrpo.config.docs import value_origins

    _, origins = value_origins(None, [f"{old}={VALUES[old]}"])  # `flowgrpo config show`
    assert origins[MOVED[old]] == "command line"


def test_old_keys_in_a_yaml_file_and_its_overlays(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "base: flux-kontext-counting\n"
        "model: {true_cfg_scale: 3.0, source_size: 256}\n"
        "algorithms:\n  nft:\n    model: {true_cfg_scale: 4.0}\n"
    )
    cfg = load_config(str(mine), [], check_paths=False)
    assert (cfg.flux.true_cfg_scale, cfg.flux_kontext.source_size) == (3.0, 256)
    nft = load_config(str(mine), ["algorithm=nft"], check_paths=False)
    assert nft.flux.true_cfg_scale == 4.0
    over = load_config(str(mine), ["flux.true_cfg_scale=5"], check_paths=False)
    assert over.flux.true_cfg_scale == 5.0  # the command line wins over the file's old key
    both = tmp_path / "both.yaml"
    both.write_text("model: {true_cfg_scale: 3.0}\nflux: {true_cfg_scale: 2.0}\n")
    with pytest.raises(ConfigError, match=r"'model.true_cfg_scale' in .*both.yaml is the old "
                       r"name of 'flux.true_cfg_scale', which is also given: keep flux"):  # fmt: skip
        load_config(str(both), [], check_paths=False)


def _old_run(tmp_path: Path) -> Path:
    """A run folder whose checkpoint holds the recorded config of an older flowgrpo."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    shutil.copy(RECORDS / "flux-kontext-before-sections.yaml", ckpt / "config.yaml")
    return ckpt


def test_a_run_recorded_before_the_sections_resumes(tmp_path):
    ckpt = _old_run(tmp_path)
    recorded = checkpoint_record(ckpt)
    assert recorded["flux"] == {"true_cfg_scale": 2.5} and "true_cfg_scale" not in recorded["model"]
    cfg = load_config(None, [], check_paths=False, recorded=recorded)
    assert (cfg.flux.true_cfg_scale, cfg.flux_kontext.source_size) == (2.5, 512)
    assert cfg.model.max_sequence_length == 128 and cfg.preset == "flux-kontext-counting"
    check_resume(cfg, ckpt)  # nothing changed: the old form and the new compare equal
    changed = load_config(None, ["flux.true_cfg_scale=3"], check_paths=False, recorded=recorded)
    with pytest.raises(ConfigError, match=r"cannot resume .*\(flux.true_cfg_scale differ"):
        check_resume(changed, ckpt)  # a family's section defines the run
    # the recorded config against a FLUX.1 Kontext pipeline's config files: its options pass
    configs = {"model_index": {"_class_name": "FluxKontextPipeline"}, "vae": {}}
    check_model_run(cfg, configs)
    assert adapter_kwargs(cfg, "FluxKontextPipeline") == {
        "true_cfg_scale": 2.5,
        "source_size": 512,
        "max_sequence_length": 128,
    }


def test_a_setting_of_another_family_is_refused_naming_the_key_and_both_families():
    kontext = load_config(None, ["flux_kontext.source_size=64"], check_paths=False)
    with pytest.raises(ConfigError, match=r"^config key 'flux_kontext.source_size' does not "
                       r"apply to FluxPipeline \(family flux\): it is a setting of family "
                       r"flux_kontext, not one of the options FluxPipeline takes "
                       r"\(max_sequence_length, true_cfg_scale\); unset it$"):  # fmt: skip
        adapter_kwargs(kontext, "FluxPipeline")
    old_key = ["model.guidance_scale_2=3"]
    wan = load_config("z-image-pickscore", old_key, check_paths=False)
    with pytest.raises(ConfigError, match="'wan.guidance_scale_2' does not apply to "
                       r"ZImagePipeline \(family zimage\): it is a setting of family wan"):  # fmt: skip
        check_model_run(wan, {"model_index": {"_class_name": "ZImagePipeline"}})
    assert adapter_kwargs(wan, "WanPipeline") == {"guidance_scale_2": 3.0}
    flux = load_config(None, ["flux.true_cfg_scale=2"], check_paths=False)
    assert adapter_kwargs(flux, "FluxKontextPipeline") == {"true_cfg_scale": 2.0}  # FLUX.1's
    assert adapter_kwargs(load_config(None, [], check_paths=False), "FluxPipeline") == {}


def test_each_preset_says_in_its_yaml_what_it_is_made_for():
    from flowgrpo.planner.models import known_models, read_model_configs

    pipelines = preset_pipelines()
    assert set(pipelines) == set(list_presets())  # a new preset says what it fits
    for preset, classes in pipelines.items():
        assert classes and set(classes) <= set(registry.SUPPORTED_PIPELINES), preset
    used = {c for classes in pipelines.values() for c in classes}
    assert used == set(registry.SUPPORTED_PIPELINES) - {
        "QwenImageEditPlusPipeline"  # trained with qwen-image-edit-counting's settings
    }
    for preset, model, extra in preset_models():
        assert model in known_models(), (preset, model)
        index = read_model_configs(f"known:{model}")["model_index"]
        assert index["_class_name"] in pipelines[preset], (preset, model)
        cfg = load_config(preset, [f"model.path=known:{model}", *extra], check_paths=False)
        assert all(e.split("=")[0] in valid_keys() for e in extra) and cfg.preset == preset
    rows = [(p, m) for p, m, _ in preset_models()]
    assert ("wan-t2v-ocr", "wan2.2-t2v-a14b") in rows and ("sd3-ocr", "sd3.5-large") in rows


def test_made_for_is_not_a_setting(tmp_path):
    cfg = load_config("flux-pickscore", [], check_paths=False)
    assert "made_for" not in config_to_dict(cfg)
    mine = tmp_path / "mine.yaml"  # a user's own file may say it too: read, never trained on
    mine.write_text("base: sd3-ocr\nmade_for: {pipelines: [StableDiffusion3Pipeline]}\n")
    assert load_config(str(mine), [], check_paths=False).preset == "mine"
    mine.write_text("made_for: 3\n")
    with pytest.raises(ConfigError, match=r"'made_for' in .*mine.yaml must be a mapping"):
        load_config(str(mine), [], check_paths=False)
    with pytest.raises(ConfigError, match="made_for"):
        load_config(None, ["made_for.pipelines=[FluxPipeline]"], check_paths=False)


def test_reading_the_config_imports_no_diffusers():
    """The families' settings are read at import: their adapter files stay light (Wan's
    experts, which subclass a diffusers mixin, load on first use)."""
    code = "import sys, flowgrpo.config; assert 'diffusers' not in sys.modules, 'diffusers'"
    subprocess.run([sys.executable, "-c", code], check=True)
