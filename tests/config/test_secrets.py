from flowgrpo.config.secrets import REDACTED, is_secret_name, redact


def test_secret_names_by_last_word():
    for name in ("token", "api_key", "auth_token", "HF_TOKEN", "secret", "password", "apikey"):
        assert is_secret_name(name), name
    for name in ("tokens_per_step", "key_frames", "monkey", "keyword", "max_tokens", "url"):
        assert not is_secret_name(name), name


def test_redact_nested_keeps_everything_else():
    cfg = {
        "reward": [{"name": "remote", "options": {"url": "http://x", "token": "s3cr3t"}}],
        "run": {"output_dir": "runs/a", "api_key": None},
        "seed": 3,
    }
    out = redact(cfg)
    assert out["reward"][0]["options"] == {"url": "http://x", "token": REDACTED}
    assert out["run"] == {"output_dir": "runs/a", "api_key": None}
    assert out["seed"] == 3
    assert cfg["reward"][0]["options"]["token"] == "s3cr3t"  # the input is untouched
    assert "s3cr3t" not in repr(out)


def test_redact_args_hides_secret_values_on_a_command_line():
    from flowgrpo.config.secrets import redact_args

    args = ["train", "reward.remote.options.token=abc", "--token", "xyz", "--api-key=k1"]
    args += ["reward.remote.options.url=http://h:1/", "seed=3", "--token=", "monkey=1"]
    assert redact_args(args) == [
        "train",
        f"reward.remote.options.token={REDACTED}",
        "--token",
        REDACTED,
        f"--api-key={REDACTED}",
        "reward.remote.options.url=http://h:1/",
        "seed=3",
        "--token=",
        "monkey=1",
    ]
