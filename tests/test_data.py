"""Prompt data: arithmetic splits, coloured-square pictures whose answers are recounted from their pixels, JSONL
loading with errors that name file and line, and the sampler's determinism, epoch rollover, data-parallel slices
and resume."""

from __future__ import annotations

import json

import pytest

from megarl.data.arithmetic import little_endian, make_arithmetic_splits
from megarl.data.prompts import DataError, PromptRow, PromptSampler, load_prompts


# ---- arithmetic splits -----------------------------------------------------------------------------------
def test_splits_are_deterministic_for_a_seed_and_differ_across_seeds(tmp_path):
    a = make_arithmetic_splits(tmp_path / "a", seed=3, digits=2, train_size=500, heldout_size=64)
    b = make_arithmetic_splits(tmp_path / "b", seed=3, digits=2, train_size=500, heldout_size=64)
    c = make_arithmetic_splits(tmp_path / "c", seed=4, digits=2, train_size=500, heldout_size=64)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != c[0].read_bytes()


def test_heldout_shares_no_operand_pair_with_train_in_either_order(tmp_path):
    train_path, heldout_path = make_arithmetic_splits(tmp_path, seed=0, digits=2, train_size=2000,
                                                      heldout_size=256)
    def pairs(path):
        return {frozenset(row.prompt[:-1].split("+")) for row in load_prompts(path)}
    train, heldout = load_prompts(train_path), load_prompts(heldout_path)
    assert (len(train), len(heldout)) == (2000, 256)
    assert len({r.prompt for r in train}) == 2000 and len({r.prompt for r in heldout}) == 256
    assert not pairs(train_path) & pairs(heldout_path)


def test_rows_are_little_endian_sums(tmp_path):
    assert little_endian(41, 3) == "140" and little_endian(1012, 4) == "2101"
    train_path, _ = make_arithmetic_splits(tmp_path, seed=1, digits=3, train_size=300, heldout_size=16)
    for row in load_prompts(train_path):
        a, b = row.prompt.removesuffix("=").split("+")
        assert len(a) == len(b) == 3 and len(row.answer) == 4
        assert int(row.answer[::-1]) == int(a[::-1]) + int(b[::-1]), row


def test_too_many_rows_asked_for_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="fewer than"):
        make_arithmetic_splits(tmp_path, digits=1, train_size=95, heldout_size=10)


def test_command_line_writes_both_splits(tmp_path, capsys):
    from megarl.data.arithmetic import main

    main(["--out", str(tmp_path), "--seed", "2", "--digits", "2", "--train-size", "100", "--heldout-size", "8"])
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 100
    assert len((tmp_path / "heldout.jsonl").read_text().splitlines()) == 8
    assert "heldout.jsonl" in capsys.readouterr().out


# ---- digit copying -------------------------------------------------------------------------------------------
def test_copying_splits_are_disjoint_and_their_pairs_reject_wrong_copies(tmp_path):
    """Rows ask for their prompt's digits; no string is in both splits; every pair's chosen is the answer and
    its rejected response differs from it, each kind drawn near its odds; same seed, same bytes."""
    from collections import Counter

    from megarl.data.copying import REJECTED_KINDS, main, make_copying_splits, wrong_copy

    main(["--out", str(tmp_path / "a"), "--train-size", "2000", "--heldout-size", "64"])
    paths = make_copying_splits(tmp_path / "b", train_size=2000, heldout_size=64)
    assert [p.name for p in paths] == ["train.jsonl", "heldout.jsonl", "train_pairs.jsonl", "heldout_pairs.jsonl"]
    assert all(p.read_bytes() == (tmp_path / "a" / p.name).read_bytes() for p in paths)
    train, heldout, train_pairs, heldout_pairs = ([json.loads(line) for line in p.read_text().splitlines()]
                                                  for p in paths)
    assert len(train) == 2000 and len(heldout) == 64
    for row in train + heldout:
        assert row["prompt"] == row["answer"] + "=" and len(row["answer"]) == 6 and row["answer"].isdigit()
    assert not {r["answer"] for r in train} & {r["answer"] for r in heldout}
    assert len({r["answer"] for r in train}) == 2000
    for rows, pairs in ((train, train_pairs), (heldout, heldout_pairs)):
        assert [(p["prompt"], p["chosen"]) for p in pairs] == [(r["prompt"], r["answer"]) for r in rows]
        assert all(p["rejected"] != p["chosen"] for p in pairs)
    # 4000 draws: each kind's share within 0.03 of its odds (3 standard errors of the 0.15 share is 0.017)
    rng = __import__("random").Random(5)
    kinds = Counter(wrong_copy("012345", rng)[1] for _ in range(4000))
    for kind, odds in REJECTED_KINDS:
        assert kinds[kind] / 4000 == pytest.approx(odds, abs=0.03), kinds
    replaced = [wrong_copy("012345", rng) for _ in range(2000)]
    changed = Counter(sum(a != b for a, b in zip(text, "012345")) for text, kind in replaced if kind == "replaced")
    # one digit in half of the near misses (about 1400 here: a standard error of 0.013), two or three in the rest
    assert set(changed) == {1, 2, 3} and changed[1] / sum(changed.values()) == pytest.approx(0.5, abs=0.05)
    lengths = {len(text) for text, kind in replaced if kind == "length"}
    assert lengths == {5, 7}


def test_copying_refuses_more_rows_than_its_strings_can_give(tmp_path):
    from megarl.data.copying import make_copying_splits

    with pytest.raises(ValueError, match="too few"):
        make_copying_splits(tmp_path, digits=2, train_size=45, heldout_size=10)


# ---- coloured squares ----------------------------------------------------------------------------------------
def squares_in(image_path) -> list[tuple[int, str]]:
    """(side, colour word) of every square in a picture, found from its pixels alone: each 4-connected region of
    one non-background colour, which must fill its bounding square exactly and be a palette colour."""
    import numpy as np
    from PIL import Image

    from megarl.data.shapes import BACKGROUND, PALETTE

    pixels = np.asarray(Image.open(image_path).convert("RGB"))
    names = {rgb: name for name, rgb in PALETTE.items()}
    height, width, _ = pixels.shape
    seen = np.all(pixels == BACKGROUND, axis=-1)
    found = []
    for y, x in zip(*np.nonzero(~seen)):
        if seen[y, x]:
            continue
        colour = tuple(int(c) for c in pixels[y, x])
        assert colour in names, f"{image_path}: pixel ({y}, {x}) is {colour}, neither background nor a palette colour"
        region, stack, seen[y, x] = [], [(y, x)], True
        while stack:
            cy, cx = stack.pop()
            region.append((cy, cx))
            for ny, nx in ((cy - 1, cx), (cy + 1, cx), (cy, cx - 1), (cy, cx + 1)):
                if 0 <= ny < height and 0 <= nx < width and not seen[ny, nx] and \
                        tuple(int(c) for c in pixels[ny, nx]) == colour:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        ys, xs = [r[0] for r in region], [r[1] for r in region]
        side = max(ys) - min(ys) + 1
        assert max(xs) - min(xs) + 1 == side and len(region) == side * side, \
            f"{image_path}: the {names[colour]} region at ({y}, {x}) is not a filled square"
        found.append((side, names[colour]))
    return found


def test_shapes_answers_are_what_the_pictures_show(tmp_path):
    from megarl.data.shapes import LARGEST_MARGIN, QUESTIONS, make_shapes_splits

    paths = make_shapes_splits(tmp_path, seed=2, train_size=150, heldout_size=30, size=48)
    kinds = {question: kind for kind, question in QUESTIONS.items()}
    asked, pictures = {"count": 0, "largest": 0}, set()
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            image, = row["images"]
            pictures.add((path.parent / image).read_bytes())
            squares = sorted(squares_in(path.parent / image), reverse=True)
            assert 1 <= len(squares) <= 5
            kind = kinds[row["prompt"]]
            asked[kind] += 1
            if kind == "count":
                assert row["answer"] == str(len(squares))
            else:
                assert row["answer"] == squares[0][1]
                assert all(squares[0][0] >= LARGEST_MARGIN * side for side, _ in squares[1:]), "largest ambiguous"
    assert len(pictures) == 180  # every picture differs from every other, across the splits
    assert min(asked.values()) > 50  # both questions asked, about evenly (180 rows, odds 1/2 each)


def test_shapes_are_the_same_bytes_for_a_seed_and_load_as_prompt_rows(tmp_path):
    from megarl.data.shapes import main

    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        main(["--out", str(tmp_path / name), "--train", "20", "--heldout", "4", "--seed", str(seed), "--size", "40"])
    files = {name: {p.relative_to(tmp_path / name): p.read_bytes() for p in sorted((tmp_path / name).rglob("*"))
                    if p.is_file()} for name in "abc"}
    assert len(files["a"]) == 2 + 24 and files["a"] == files["b"] and files["a"] != files["c"]
    rows = load_prompts(tmp_path / "a" / "train.jsonl", metadata_key=None)
    assert len(rows) == 20 and rows[0].metadata["images"] == ["images/train_00000.png"]
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "d"), "--size", "16"])


# ---- load_prompts ------------------------------------------------------------------------------------------
def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_load_prompts_reads_rows_custom_keys_and_metadata(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"q": "1+1=", "a": "2", "level": 1}), "",
                                              json.dumps({"q": "2+2=", "a": "4"})])
    rows = load_prompts(path, prompt_key="q", answer_key="a")
    assert rows == [PromptRow("1+1=", "2", 0, {"level": 1}), PromptRow("2+2=", "4", 1, {})]


@pytest.mark.parametrize("bad_line, what", [
    # the parser's own position: the 42nd character is the second comma
    ('{"prompt": "2+2=", "answer": "4", "x": 1,, "y": 2}', "invalid JSON (Expecting property name enclosed in "
                                                            "double quotes at column 42)"),
    # cut short after a comma (a line killed mid-write): the parser's line 2, column 1 is the line's end
    ('{"prompt": "2+2=", "answer": "4",', "invalid JSON (Expecting property name enclosed in double quotes at "
                                          "column 34) (the line ends before the JSON value does)"),
])
def test_invalid_json_is_reported_at_its_column_in_the_line(tmp_path, bad_line, what):
    path = write_lines(tmp_path / "bad.jsonl", [bad_line])
    with pytest.raises(DataError) as err:
        load_prompts(path)
    assert f"{path}:1: {what}" in str(err.value)


@pytest.mark.parametrize("bad_line, what", [
    ('{"prompt": "2+2=", "answer": ', "invalid JSON"),
    ('{"answer": "4"}', "missing key 'prompt'"),
    ('{"prompt": "2+2=", "answer": 4}', "'answer' must be a string, got int"),
    ('["2+2=", "4"]', "expected a JSON object"),
])
def test_malformed_row_names_file_line_and_problem(tmp_path, bad_line, what):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "1+1=", "answer": "2"}', "", bad_line])
    with pytest.raises(DataError) as err:
        load_prompts(path)
    assert f"{path}:3" in str(err.value) and what in str(err.value)
    assert isinstance(err.value, ValueError)


def test_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="empty file") as err:
        load_prompts(path)
    assert str(path) in str(err.value)


# ---- PromptSampler -----------------------------------------------------------------------------------------
def draw(sampler, n, batches):
    return [sampler.next_batch(n) for _ in range(batches)]


def test_sampler_is_deterministic_for_a_seed_and_shuffles():
    first = draw(PromptSampler(10, seed=7), 4, 6)
    assert first == draw(PromptSampler(10, seed=7), 4, 6)
    assert first != draw(PromptSampler(10, seed=8), 4, 6)
    assert sum(first, [])[:10] != list(range(10))
    assert draw(PromptSampler(10, seed=7, shuffle=False), 5, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_each_epoch_is_a_new_permutation_and_epochs_join_across_a_batch():
    sampler = PromptSampler(10, seed=1)
    stream = sum(draw(sampler, 4, 5), [])  # 20 indices: a batch (8..11) straddles the epoch boundary
    epoch0, epoch1 = stream[:10], stream[10:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert sampler.state_dict() == {"epoch": 1, "position": 10}


def test_batch_larger_than_the_data_spans_epochs():
    sampler = PromptSampler(3, seed=0)
    batch = sampler.next_batch(7)
    assert [sorted(batch[i:i + 3]) for i in (0, 3)] == [[0, 1, 2]] * 2 and len(batch) == 7
    assert sampler.state_dict() == {"epoch": 2, "position": 1}


def test_dp_ranks_get_disjoint_slices_that_cover_the_global_batch():
    single = PromptSampler(24, seed=5)
    ranks = [PromptSampler(24, seed=5, dp_rank=r, dp_size=3) for r in range(3)]
    for _ in range(5):  # 5 global batches of 12 rows cross two epoch boundaries
        slices = [s.next_batch(4) for s in ranks]
        assert sum(slices, []) == single.next_batch(12)
    assert ranks[0].state_dict() == ranks[2].state_dict() == single.state_dict()


def test_restored_sampler_continues_like_the_uninterrupted_one():
    uninterrupted = PromptSampler(10, seed=3, dp_rank=1, dp_size=2)
    draw(uninterrupted, 3, 4)
    state = dict(uninterrupted.state_dict())
    expected = draw(uninterrupted, 3, 6)
    restored = PromptSampler(10, seed=3, dp_rank=1, dp_size=2)
    restored.load_state_dict(json.loads(json.dumps(state)))  # states survive a JSON round trip
    assert draw(restored, 3, 6) == expected


@pytest.mark.parametrize("kwargs", [dict(n_rows=0), dict(dp_rank=2, dp_size=2), dict(dp_rank=-1)])
def test_sampler_rejects_impossible_arguments(kwargs):
    with pytest.raises(ValueError):
        PromptSampler(**{"n_rows": 4, "seed": 0, **kwargs})


def test_state_that_does_not_fit_the_data_is_rejected():
    with pytest.raises(ValueError, match="does not fit"):
        PromptSampler(4, seed=0).load_state_dict({"epoch": 0, "position": 5})


# ---- formats, metadata field, bad rows -------------------------------------------------------------------
def test_parquet_and_jsonl_load_the_same_rows_with_a_metadata_field(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    records = [{"question": "1+1=", "solution": "#### 2", "info": {"level": 1}},
               {"question": "2+3=", "solution": "#### 5", "info": {"level": 2}}]
    jsonl = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in records])
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    keys = dict(prompt_key="question", answer_key="solution", metadata_key="info")
    expected = [PromptRow("1+1=", "#### 2", 0, {"level": 1}), PromptRow("2+3=", "#### 5", 1, {"level": 2})]
    assert load_prompts(jsonl, **keys) == load_prompts(parquet, **keys) == expected


def test_a_malformed_parquet_row_names_file_and_row(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]), path)
    with pytest.raises(DataError, match=f"{path}:row 2: 'prompt' must be a string, got NoneType"):
        load_prompts(path)


def test_metadata_field_that_is_not_a_mapping_names_the_line(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", ['{"prompt": "p", "answer": "a", "info": [1]}'])
    with pytest.raises(DataError, match=f"{path}:1: 'info' must be a mapping, got list"):
        load_prompts(path, metadata_key="info")


def test_skip_bad_rows_counts_and_warns_once(tmp_path, caplog):
    good = '{"prompt": "1+1=", "answer": "2"}'
    path = write_lines(tmp_path / "mixed.jsonl", [good, '{"prompt": ', '{"answer": "4"}', "",
                                                   '{"prompt": "2+2=", "answer": 4}', good])
    with caplog.at_level("WARNING", logger="megarl.data.prompts"):
        rows = load_prompts(path, skip_bad_rows=True)
    assert [r.index for r in rows] == [0, 1] and [r.prompt for r in rows] == ["1+1=", "1+1="]
    [record] = caplog.records
    assert f"{path}: skipped 3 malformed rows of 5 (first: {path}:2: invalid JSON" in record.message


def test_skip_bad_rows_with_nothing_left_is_an_error(tmp_path):
    path = write_lines(tmp_path / "allbad.jsonl", ["[1]", "{}"])
    with pytest.raises(DataError, match=f"{path}: all 2 rows are malformed"):
        load_prompts(path, skip_bad_rows=True)


def test_math_word_sets_are_deterministic_and_load(tmp_path, capsys):
    from megarl.data.math_word import main, make_math_word_sets

    a = make_math_word_sets(tmp_path / "a", seed=1, size=30)
    b = make_math_word_sets(tmp_path / "b", seed=1, size=30)
    c = make_math_word_sets(tmp_path / "c", seed=2, size=30)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != c[0].read_bytes()
    gsm8k, math_style = (load_prompts(p) for p in a)
    assert len(gsm8k) == len(math_style) == 30
    assert all(r.answer.rsplit("\n", 1)[1].startswith("#### ") for r in gsm8k)
    assert {r.metadata["subject"] for r in math_style} <= {"fractions", "algebra", "radicals", "probability",
                                                          "number_theory"}
    main(["--out", str(tmp_path / "cli"), "--size", "3"])
    assert "math_style.jsonl" in capsys.readouterr().out
