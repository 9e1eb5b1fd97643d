"""Prompt files, train/eval splits and the distributed K-repeat sampler."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from flowgrpo.data.prompts import (
    KRepeatSampler,
    load_prompts,
    prompt_splits,
    rank_slice,
    split_dataset,
)


def test_txt_and_jsonl(tmp_path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n\n  a dog  \n\n")
    ds = load_prompts(txt)
    assert ds.prompts == ["a cat", "a dog"] and ds.metadata == [{}, {}]
    jl = tmp_path / "p.jsonl"
    rows = [{"prompt": 'a sign "OPEN"', "text": "OPEN"}, {"prompt": "x", "tags": [1, 2]}]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = load_prompts(jl)
    assert ds.prompts == ['a sign "OPEN"', "x"]
    assert ds.metadata == [{"text": "OPEN"}, {"tags": [1, 2]}]
    assert ds.select([1, 1])[0] == ["x", "x"] and len(ds.subset([0])) == 1


def test_loader_errors(tmp_path) -> None:
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"prompt": "ok"}\n\n{"caption": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: missing 'prompt' field"):
        load_prompts(jl)
    jl.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_prompts(jl)
    jl.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'prompt' must be a non-empty string"):
        load_prompts(jl)
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "missing.txt")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="e.jsonl contains no prompts"):
        load_prompts(tmp_path / "e.jsonl")
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(ValueError, match="use .txt, .jsonl or .parquet"):
        load_prompts(tmp_path / "p.csv")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path) -> None:
    try:  # pyarrow is not a dependency: without it .parquet is a one-line error
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "p.parquet").write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs pyarrow"):
            load_prompts(tmp_path / "p.parquet")


def test_digits_and_splits(tmp_path) -> None:
    d = load_prompts("builtin:digits")  # the toy's set, shipped in the package
    assert d.prompts[7] == "a handwritten 7" and d.metadata[7] == {"digit": 7} and len(d) == 10
    tr, ev = split_dataset(d, 0.3, seed=1)
    assert (len(tr), len(ev)) == (7, 3) and not set(tr.prompts) & set(ev.prompts)
    assert split_dataset(d, 0.3, seed=1)[1].prompts == ev.prompts  # deterministic
    assert split_dataset(d, 0.0) == (d, d)
    with pytest.raises(ValueError, match="no built-in prompt set 'builtin:digitz'"):
        load_prompts("builtin:digitz")
    cfg = SimpleNamespace(
        train_prompts="builtin:digits", eval_prompts=None, eval_fraction=0.0, eval_num_prompts=4
    )
    tr, ev = prompt_splits(cfg)
    assert len(tr) == 10 and ev.prompts == d.prompts[:4]
    f = tmp_path / "eval.txt"
    f.write_text("e1\ne2\n")
    tr, ev = prompt_splits(SimpleNamespace(train_prompts="builtin:digits", eval_prompts=str(f),
                                           eval_fraction=0.5, eval_num_prompts=0))  # fmt: skip
    assert len(tr) == 10 and ev.prompts == ["e1", "e2"]


def test_k_repeat_groups_across_ranks() -> None:
    n, m, k, world = 13, 4, 6, 3
    single = KRepeatSampler(n, m, k, seed=5)
    for step in range(7):
        idx, groups = single.global_step_samples(step)
        assert len(idx) == m * k
        counts = Counter(groups)
        assert sorted(counts) == list(range(m)) and set(counts.values()) == {k}
        for g, i in zip(groups, idx):  # a group is one prompt
            assert single.step_prompts(step)[g] == i
        assert len(set(single.step_prompts(step))) == m  # m <= n: no prompt twice in a step
        slices = [rank_slice(len(idx), world, r) for r in range(world)]
        parts = [(idx[a : a + c], groups[a : a + c]) for a, c in slices]
        assert all(len(p[0]) == m * k // world for p in parts)
        assert sum((p[0] for p in parts), []) == idx and sum((p[1] for p in parts), []) == groups
        assert any(len(set(p[1])) > 1 for p in parts)  # groups are spread, not rank-aligned
    with pytest.raises(ValueError, match="must divide evenly over 5 data-parallel ranks"):
        rank_slice(m * k, 5, 0)


def test_k_repeat_epochs_cover_every_prompt_once() -> None:
    s = KRepeatSampler(12, 4, 2, seed=0)
    drawn = [p for step in range(3) for p in s.step_prompts(step)]
    assert sorted(drawn) == list(range(12))
    # 13 prompts, m=4: 3 steps an epoch, the 13th of each epoch's shuffle waits for a later one
    odd = KRepeatSampler(13, 4, 2, seed=0)
    epochs = [[p for st in range(3 * e, 3 * e + 3) for p in odd.step_prompts(st)] for e in range(4)]
    assert all(len(set(e)) == 12 for e in epochs)
    assert len({p for e in epochs for p in e}) == 13
    assert drawn != list(range(12))  # shuffled
    assert KRepeatSampler(12, 4, 2, seed=0, shuffle=False).step_prompts(1) == [4, 5, 6, 7]
    assert KRepeatSampler(12, 4, 2, seed=1).step_prompts(0) != s.step_prompts(0)
    big = KRepeatSampler(3, 5, 2, seed=0)  # m > n: a step spans epochs; 5 groups anyway
    assert len(set(big.global_step_samples(0)[1])) == 5


def test_k_repeat_draw_is_a_function_of_the_step_and_resume_checks_the_settings() -> None:
    straight = KRepeatSampler(10, 3, 4, seed=7)
    expected = [straight.global_step_samples(step) for step in range(8)]
    state = json.loads(json.dumps(straight.state_dict()))
    resumed = KRepeatSampler(10, 3, 4, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.global_step_samples(step) for step in range(5, 8)] == expected[5:]
    other = KRepeatSampler(10, 3, 4, seed=8)
    with pytest.raises(ValueError, match="seed was 7, now 8"):
        other.load_state_dict(state)
