from flowgrpo.config.secrets import REDACTED, is_secret_name, redact


def test_secret_names_by_last_word():
    for name in ("token", "api_key", "auth_token", "HF_TOKEN", "secret", "password", "apikey",
                 "Authorization", "credentials", "basic_auth", "session_cookie"):  # fmt: skip
        assert is_secret_name(name), name
    for name in ("tokens_per_step", "key_frames", "monkey", "keyword", "max_tokens", "url",
                 "author", "authors", "timeout"):  # fmt: skip
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


# -- a secret inside a structured override (issue 40, item 1) ----------------------------------

SECRET = "s3cr3t-9f3a"
STRUCTURED = [
    f"reward=[{{name: remote, options: {{url: 'http://h:1/', token: {SECRET}}}}}]",
    f"reward.remote.options={{url: 'http://h:1/', token: {SECRET}}}",
    f'reward.remote.options={{"server": {{"api_key": "{SECRET}"}}, "urls": [{{"password": "{SECRET}"}}]}}',
    f"reward.remote.options.token={SECRET}",
    f"reward.remote.options.auth.password={SECRET}",
    f"reward.remote.options={{token: {SECRET}",  # does not parse: hidden whole
]


def test_redact_args_hides_secrets_inside_structured_values():
    import yaml

    from flowgrpo.config.secrets import redact_args

    out = redact_args(["train", *STRUCTURED, "reward.remote.options={url: 'http://h:1/'}"])
    assert SECRET not in " ".join(out), out
    assert out[-1] == "reward.remote.options={url: 'http://h:1/'}"  # no secret: as typed
    first = yaml.safe_load(out[1].split("=", 1)[1])  # still the same structure, token hidden
    assert first == [{"name": "remote", "options": {"url": "http://h:1/", "token": REDACTED}}]
    third = yaml.safe_load(out[3].split("=", 1)[1])
    assert third == {"server": {"api_key": REDACTED}, "urls": [{"password": REDACTED}]}
    assert out[6] == f"reward.remote.options={REDACTED}"


def test_recorded_command_line_and_config_hide_a_structured_token(monkeypatch):
    from flowgrpo import cli
    from flowgrpo.config import load_config
    from flowgrpo.config.record import record_text

    args = ["train", STRUCTURED[0], "trainer.max_steps=1"]
    monkeypatch.setattr(cli, "current_argv", args)
    text = record_text(load_config(None, args[1:], check_paths=False))
    assert SECRET not in text
    assert "# command: flowgrpo train 'reward=[{name: remote, options: {url:" in text
    assert f"token: {REDACTED}" in text


def test_config_show_and_type_errors_print_no_secret(capsys):
    from flowgrpo import cli

    for overrides in ([STRUCTURED[0]], ["reward=remote", STRUCTURED[1]]):
        assert cli.main(["config", "show", *overrides]) == 0
        shown = capsys.readouterr().out
        assert SECRET not in shown and f"token: {REDACTED}" in shown
    assert cli.main(["config", "show", f"reward.digits.options={{token: {SECRET}, x: [1}}"]) != 0
    err = capsys.readouterr().err
    assert SECRET not in err and "reward.digits.options" in err


def test_the_recorded_command_is_the_running_ones_and_survives_bytes_that_are_not_utf8(
    monkeypatch, tmp_path
):
    """A command line with bytes that are not UTF-8 (lone surrogates in argv) is recorded with
    them escaped, not a crash writing config.yaml; a command that ended leaves nothing behind
    for a run started later from Python (it records its own process's command line)."""
    from flowgrpo import cli
    from flowgrpo.config import load_config
    from flowgrpo.config.record import command_line, record_text

    assert cli.main(["sample", "--prompts", "ok", "a\udcffb", "--out", str(tmp_path)]) == 2
    assert cli.current_argv is None  # the failed command's arguments are not kept
    monkeypatch.setattr("sys.orig_argv", ["python", "train.py", "x\udcffy"])
    assert command_line() == "python train.py 'x\\udcffy'"
    text = record_text(load_config(None, ["trainer.max_steps=1"], check_paths=False))
    (tmp_path / "config.yaml").write_text(text, encoding="utf-8")
    assert "# command: python train.py 'x\\udcffy'\n" in text
