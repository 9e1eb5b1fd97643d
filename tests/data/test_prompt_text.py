"""Prompt files as text (issue 40, items 4 and 8): lines are split on "\\n" only (a Unicode
line or paragraph separator inside a line is part of the prompt), a lone surrogate in a
prompt and a duplicate key in a .jsonl record are refused at load naming the file and line,
and a source path that is a directory or a symlink loop says what it is."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from flowgrpo.data.prompts import load_prompts


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c"])
def test_txt_lines_split_on_newline_only(tmp_path, sep) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(f"a cat{sep}on a mat\r\nsecond line\n".encode())
    ds = load_prompts(f)
    assert ds.prompts == [f"a cat{sep}on a mat", "second line"]
    assert ds.locations == [f"{f}:1", f"{f}:2"]


@pytest.mark.parametrize("sep", ["\u2028", "\x85"])
def test_jsonl_with_a_raw_unicode_separator_in_a_string_loads(tmp_path, sep) -> None:
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": f"a{sep}b", "text": f"x{sep}y"}, {"prompt": "c"}]
    f.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    ds = load_prompts(f)
    assert ds.prompts == [f"a{sep}b", "c"] and ds.metadata[0] == {"text": f"x{sep}y"}
    assert ds.locations == [f"{f}:1", f"{f}:2"]


def test_a_lone_surrogate_is_refused_with_file_and_line(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "bad \\ud800 here"}\n')
    with pytest.raises(ValueError) as info:
        load_prompts(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}:2: ") and "'prompt'" in msg and "surrogate" in msg
    assert "\n" not in msg
    f.write_text('{"prompt": "ok", "meta": {"text": ["\\udfff"]}}\n')
    with pytest.raises(ValueError, match=rf"{f}:1: .*'meta'.*surrogate"):
        load_prompts(f)
    f.write_text('{"prompt": "a pair \\ud83d\\ude00 is fine"}\n')
    assert load_prompts(f).prompts == ["a pair \U0001f600 is fine"]


def test_a_duplicate_key_is_refused_with_file_line_and_key(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b", "text": "X", "text": "Y"}\n')
    with pytest.raises(ValueError) as info:
        load_prompts(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}:3: ") and "duplicate key 'text'" in msg and "\n" not in msg
    f.write_text('{"prompt": "a", "meta": {"k": 1, "k": 2}}\n')
    with pytest.raises(ValueError, match=rf"{f}:1: duplicate key 'k'"):
        load_prompts(f)


def test_a_source_that_is_a_directory_or_a_symlink_loop_says_so(tmp_path) -> None:
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "ok.png")
    (tmp_path / "folder").mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.png")
    f = tmp_path / "e.jsonl"
    for name, expected in (
        ("folder", "is a directory, not an image file"),
        ("loop", "is a symlink loop"),
        ("dangling", f"is a broken symlink (to {tmp_path / 'gone.png'})"),
        ("gone.png", "not found"),
    ):
        f.write_text(json.dumps({"prompt": "p", "image": "ok.png"}) + "\n")
        f.write_text(f.read_text() + json.dumps({"prompt": "p", "image": name}) + "\n")
        with pytest.raises(ValueError) as info:
            load_prompts(f)
        msg = str(info.value)
        assert msg == f"{f}:2: image {tmp_path / name} {expected}", msg


def test_sample_prompts_that_are_not_utf8_are_one_line(tmp_path, capsys) -> None:
    """Bytes that are not UTF-8 on the command line reach argv as lone surrogates: refused
    before anything loads (a tokenizer TypeError otherwise)."""
    from flowgrpo.cli import main

    assert main(["sample", "--prompts", "ok", "a\udcffb", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompts: 'a\\udcffb' is not UTF-8 text" in err and len(err.splitlines()) == 1
