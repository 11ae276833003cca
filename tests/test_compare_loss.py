"""titan_uniep.tools.compare_loss: parsing, verdicts and exit codes (no training)."""

import json
import math

import numpy as np
import pytest

from titan_uniep.tools.compare_loss import compare, load_run, main, window_max_rel

LOSSES = [8.080501556396484, 7.932784557342529, 7.349606513977051]


def write_dump(folder, losses, start=1):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "loss.jsonl", "w") as f:
        for step, loss in enumerate(losses, start):
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.0, "time": 0.1 * step}) + "\n")
    return folder


def write_log(path, losses, colour=False):
    red, green, reset = ("\x1b[31m", "\x1b[32m", "\x1b[39m") if colour else ("", "", "")
    lines = ["[rank0]:[titan] 2026-01-01 00:00:00,000 - root - INFO - Training starts at step 1"]
    for step, loss in enumerate(losses, 1):
        lines.append(
            f"[rank0]:[titan] 2026-01-01 00:00:0{step},000 - root - INFO - {red}step: {step:2}  "
            f"{green}loss: {loss:8.5f}  grad_norm:  1.0000  memory:  1.24GiB(5.29%)  tps: 268{reset}"
        )
        lines.append(f"[rank0]:[titan] - root - INFO - validate step: {step:2}  loss:  1.00000  memory: 0GiB")
    path.write_text("\n".join(lines) + "\n")
    return path


def run_main(*argv):
    return main([str(a) for a in argv])


def test_log_parsing_strips_colours_and_skips_validation_lines(tmp_path):
    run = load_run(write_log(tmp_path / "train.log", LOSSES, colour=True))
    assert not run.exact
    assert run.losses == {1: 8.0805, 2: 7.93278, 3: 7.34961}


def test_dump_folder_keeps_exact_floats_and_last_value_of_a_repeated_step(tmp_path):
    folder = write_dump(tmp_path / "run", LOSSES)
    with open(folder / "loss.jsonl", "a") as f:  # a resumed run logs step 3 again
        f.write(json.dumps({"step": 3, "loss": 7.0}) + "\n")
    run = load_run(folder)
    assert run.exact
    assert run.losses == {1: LOSSES[0], 2: LOSSES[1], 3: 7.0}
    assert run.repeated == [3]
    assert load_run(folder / "loss.jsonl").losses == run.losses


def test_a_run_with_repeated_steps_is_compared_on_their_last_records_and_says_so(tmp_path, capsys):
    # A loss.jsonl of a run resumed into its dump folder before loss_file kept one record per step.
    a = write_dump(tmp_path / "a", LOSSES + [7.1, 7.0])
    b = write_dump(tmp_path / "b", LOSSES + [7.1, 7.0])
    with open(b / "loss.jsonl", "a") as f:  # resumed from a checkpoint at step 2: steps 3-5 again
        for step, loss in enumerate(LOSSES[2:] + [7.1, 7.0], 3):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    assert run_main(a, b, "--assert-bitwise", "--plot", tmp_path / "p.png") == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"note: {b / 'loss.jsonl'} has more than one record of steps 3-5 (a run resumed into the same folder, "
        "written before titan_uniep kept one record per step); comparing the last record of each, the resumed run's"]
    assert "verdict: bitwise equal" in captured.out


def test_a_truncated_loss_file_is_named_with_its_line(tmp_path, capsys):
    a = write_dump(tmp_path / "a", LOSSES)
    b = write_dump(tmp_path / "b", LOSSES)
    text = (b / "loss.jsonl").read_text()
    (b / "loss.jsonl").write_text(text[:text.rindex('"loss"') + 3])  # killed while writing step 3's record
    assert run_main(a, b) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {b / 'loss.jsonl'}, line 3: not a JSON record (Unterminated string starting at: "
                          "column "), err
    assert err.rstrip().endswith("the file ends in the middle of it: it looks truncated (a run killed while writing "
                                 "it). Delete line 3 to compare the other steps"), err


def test_a_record_cut_short_inside_a_loss_file_is_named_with_its_line(tmp_path):
    # Killed mid-write, then resumed into the same folder by a version that appended.
    folder = write_dump(tmp_path / "run", LOSSES)
    lines = (folder / "loss.jsonl").read_text().splitlines()
    (folder / "loss.jsonl").write_text(lines[0] + "\n" + lines[1][:20] + lines[1] + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError) as err:
        load_run(folder)
    assert str(err.value).startswith(f"{folder / 'loss.jsonl'}, line 2: not a JSON record ("), err.value
    assert "it looks cut short (a run killed while writing it, then resumed into the same folder)" in str(err.value)


def test_identical_dumps_are_bitwise_equal_and_exit_zero(tmp_path, capsys):
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", LOSSES)
    assert run_main(a, b, "--assert-bitwise", "--plot", tmp_path / "p.png") == 0
    out = capsys.readouterr().out
    assert "verdict: bitwise equal" in out
    assert "8.08050156" in out  # 9 significant digits, enough to tell float32 neighbours apart
    assert (tmp_path / "p.png").stat().st_size > 0


def test_one_float32_ulp_fails_assert_bitwise(tmp_path, capsys):
    nudged = list(LOSSES)
    nudged[1] = float(np.nextafter(np.float32(LOSSES[1]), np.float32(10)))
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", nudged)
    assert run_main(a, b, "--assert-bitwise", "--plot", tmp_path / "p.png") == 1
    assert "NOT bitwise equal" in capsys.readouterr().out
    # Without an assertion the same comparison only reports.
    assert run_main(a, b, "--plot", tmp_path / "p.png") == 0


def test_rtol_and_atol_bound_the_difference(tmp_path):
    shifted = [x * (1 + 1e-4) for x in LOSSES]
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", shifted)
    plot = ("--plot", tmp_path / "p.png")
    assert run_main(a, b, "--rtol", "1e-3", *plot) == 0
    assert run_main(a, b, "--rtol", "1e-5", *plot) == 1
    assert run_main(a, b, "--atol", "1e-2", *plot) == 0
    assert run_main(a, b, "--atol", "1e-6", *plot) == 1


def test_mean_rel_averages_the_per_step_relative_differences(tmp_path, capsys):
    nudged = [LOSSES[0], LOSSES[1] * (1 + 3e-4), LOSSES[2] * (1 - 6e-4)]
    result = compare(load_run(write_dump(tmp_path / "a", LOSSES)), load_run(write_dump(tmp_path / "b", nudged)))
    assert result.max_rel == pytest.approx(6e-4, rel=1e-9)
    assert result.mean_rel == pytest.approx((0 + 3e-4 + 6e-4) / 3, rel=1e-9)
    assert run_main(tmp_path / "a", tmp_path / "b", "--plot", tmp_path / "p.png") == 0
    assert "mean rel diff 3.000e-04 over 3 steps" in capsys.readouterr().out


def test_logs_claim_only_five_decimal_equality(tmp_path, capsys):
    almost = [x + 1e-7 for x in LOSSES]  # same 5-decimal text, different floats
    log = write_log(tmp_path / "a.log", LOSSES)
    dump = write_dump(tmp_path / "b", almost)
    result = compare(load_run(log), load_run(dump))
    assert result.bitwise and not result.exact
    assert run_main(log, dump, "--plot", tmp_path / "p.png") == 0
    assert "equal to 5 decimals" in capsys.readouterr().out
    # A bitwise claim cannot be made from a log, so asking for one is an error.
    assert run_main(log, dump, "--assert-bitwise", "--plot", tmp_path / "p.png") == 2


def test_different_step_sets_exit_two(tmp_path, capsys):
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", LOSSES[:2])
    assert run_main(a, b, "--plot", tmp_path / "p.png") == 2
    assert "only in a: [3]" in capsys.readouterr().err


def test_max_step_compares_a_short_run_with_the_start_of_a_long_one(tmp_path, capsys):
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", LOSSES[:2])
    assert run_main(a, b, "--max-step", "2", "--assert-bitwise", "--plot", tmp_path / "p.png") == 0
    assert "verdict: bitwise equal" in capsys.readouterr().out


def test_max_step_includes_step_n_and_leaves_out_the_later_steps(tmp_path, capsys):
    """Two runs that differ at step 2 only: ``--max-step 2`` compares steps 1 and 2
    and finds the difference; ``--max-step 1`` compares step 1 and finds none."""
    nudged = [LOSSES[0], float(np.nextafter(np.float32(LOSSES[1]), np.float32(10))), LOSSES[2]]
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", nudged)
    assert run_main(a, b, "--max-step", "2", "--assert-bitwise", "--plot", tmp_path / "p.png") == 1
    out = capsys.readouterr().out
    assert "verdict: NOT bitwise equal" in out and "over 2 steps" in out, out
    assert run_main(a, b, "--max-step", "1", "--assert-bitwise", "--plot", tmp_path / "p.png") == 0
    out = capsys.readouterr().out
    assert "verdict: bitwise equal" in out and "over 1 steps" in out, out


@pytest.mark.parametrize("make_b", ["empty_dump", "log_without_steps", "missing"])
def test_nothing_to_compare_exits_two(tmp_path, make_b):
    a = write_dump(tmp_path / "a", LOSSES)
    b = tmp_path / "b"
    if make_b == "empty_dump":
        b.mkdir()
        (b / "loss.jsonl").write_text("")
    elif make_b == "log_without_steps":
        b = tmp_path / "b.log"
        b.write_text("Training starts at step 1\nTraceback (most recent call last):\n")
    assert run_main(a, b, "--assert-bitwise") == 2


def test_plot_is_named_after_both_runs_in_run_bs_folder(tmp_path):
    base, uniep, again = (write_dump(tmp_path / name, LOSSES) for name in ("base", "uniep", "uniep_again"))
    assert run_main(base, uniep) == 0
    assert run_main(again, uniep) == 0  # comparing uniep with another run keeps the first plot
    assert sorted(p.name for p in uniep.glob("*.png")) == ["loss_base_vs_uniep.png", "loss_uniep_again_vs_uniep.png"]
    assert run_main(base, uniep, "--labels", "baseline", "UniEP ref") == 0
    assert (uniep / "loss_baseline_vs_UniEP_ref.png").is_file()
    log = write_log(tmp_path / "b.log", LOSSES)
    assert run_main(base / "loss.jsonl", log) == 0
    assert (tmp_path / "loss_base_vs_b.png").is_file()
    assert run_main(base, uniep, "--out", tmp_path / "mine.png") == 0 and (tmp_path / "mine.png").is_file()


@pytest.mark.parametrize("args,verdict", [
    ((), "base vs uniep: NOT bitwise equal\nmax abs diff 8.081e-04, max rel diff 1.000e-04, "
         "mean rel diff 1.000e-04 over 3 steps"),
    (("--rtol", "1e-3"), "base vs uniep: NOT bitwise equal; rtol=0.001 atol=0: within\n"),
    (("--rtol", "1e-5"), "base vs uniep: NOT bitwise equal; rtol=1e-05 atol=0: EXCEEDED\n"),
])
def test_plot_title_carries_the_verdict(tmp_path, monkeypatch, args, verdict):
    from titan_uniep.tools import compare_loss

    titles = []
    monkeypatch.setattr(compare_loss, "plot", lambda *a, **kw: titles.append(a[5]))
    base, uniep = write_dump(tmp_path / "base", LOSSES), write_dump(tmp_path / "uniep", [x * (1 + 1e-4) for x in LOSSES])
    run_main(base, uniep, *args)
    assert titles[0].startswith(verdict), titles


@pytest.mark.parametrize("where", ["both", "a", "b"])
def test_a_nan_loss_is_a_difference_never_equal(tmp_path, capsys, where):
    nan = float("nan")
    a_losses, b_losses = list(LOSSES), list(LOSSES)
    if where in ("both", "a"):
        a_losses[1] = nan
    if where in ("both", "b"):
        b_losses[1] = nan
    a, b = write_dump(tmp_path / "a", a_losses), write_dump(tmp_path / "b", b_losses)
    result = compare(load_run(a), load_run(b))
    assert not result.bitwise and result.nan_steps == [2]
    assert math.isnan(result.max_rel) and math.isnan(result.mean_rel)
    # Within no tolerance, however wide.
    assert run_main(a, b, "--assert-bitwise", "--rtol", "1e9", "--atol", "1e9", "--plot", tmp_path / "p.png") == 1
    out = capsys.readouterr().out
    assert "NOT bitwise equal" in out and "NaN loss at steps [2]" in out and "EXCEEDED" in out, out


def test_runs_of_different_lengths_get_no_verdict(tmp_path, capsys):
    a, b = write_dump(tmp_path / "a", LOSSES), write_dump(tmp_path / "b", LOSSES[:2])
    assert run_main(a, b, "--assert-bitwise", "--rtol", "1", "--plot", tmp_path / "p.png") == 2
    captured = capsys.readouterr()
    assert "no verdict" in captured.err and "--max-step" in captured.err, captured.err
    assert "verdict:" not in captured.out and "within" not in captured.out, captured.out


def test_direction_counts_the_steps_below_and_signs_the_mean(tmp_path, capsys):
    a_losses = [float(x) for x in np.random.default_rng().uniform(3.0, 8.0, 9)]
    factors = [1 - 2e-3, 1 + 1e-3, 1 - 4e-3, 1.0, 1 - 1e-3, 1 + 5e-4, 1 - 3e-3, 1 - 2e-3, 1 + 2e-3]
    b_losses = [x * f for x, f in zip(a_losses, factors)]
    a, b = write_dump(tmp_path / "a", a_losses), write_dump(tmp_path / "b", b_losses)
    result = compare(load_run(a), load_run(b))
    assert result.below == 5
    assert result.mean_signed_rel == pytest.approx(sum(f - 1 for f in factors) / 9, rel=1e-6)
    assert result.mean_rel > abs(result.mean_signed_rel)
    assert run_main(a, b, "--labels", "base", "other", "--plot", tmp_path / "p.png") == 0
    out = capsys.readouterr().out
    assert f"other below base at 5 of 9 steps (56%), mean signed rel diff {result.mean_signed_rel:.3e}" in out


def test_window_averages_blocks_of_common_steps(tmp_path, capsys):
    rng = np.random.default_rng()
    a_losses = [float(x) for x in rng.uniform(3.0, 8.0, 7)]
    # Noise that cancels within each pair of steps, plus a drift in the last (short) block.
    b_losses = [a_losses[0] + 0.05, a_losses[1] - 0.05, a_losses[2] - 0.08, a_losses[3] + 0.08,
                a_losses[4] + 0.01, a_losses[5] - 0.01, a_losses[6] + 0.03]
    a, b = write_dump(tmp_path / "a", a_losses), write_dump(tmp_path / "b", b_losses)
    ra, rb = load_run(a), load_run(b)
    steps = compare(ra, rb).steps
    assert window_max_rel(ra, rb, steps, 2) == pytest.approx(0.03 / a_losses[6], rel=1e-9)
    assert window_max_rel(ra, rb, steps, 1) == pytest.approx(compare(ra, rb).max_rel, rel=1e-12)
    assert run_main(a, b, "--window", "2", "--plot", tmp_path / "p.png") == 0
    assert f"max rel diff of 2-step means {0.03 / a_losses[6]:.3e}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_main(a, b, "--window", "0")
