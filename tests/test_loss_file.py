"""titan_uniep.torchtitan.loss_file: one record per step in loss.jsonl, across a resume (no training).

A stand-in for TorchTitan's ``MetricsProcessor`` and its trainer's loop (``train_step``
asks ``should_log(step)`` after every step it trains, then ``log`` on the logging steps,
0.2.2 and 0.3.0 alike) drives ``record_losses`` through the sequences of a real run:
trained, killed mid-write, resumed from an earlier checkpoint into the same dump folder.
"""

import json

import pytest

pytest.importorskip("torchtitan")

from torchtitan.components.metrics import BaseLogger

from titan_uniep.torchtitan.loss_file import LOSS_FILE, record_losses
from titan_uniep.tools.compare_loss import load_run


class MetricsProcessor:
    """What ``record_losses`` uses of TorchTitan's: ``should_log``, ``log`` and the logger backend."""

    def __init__(self, log_freq: int = 1):
        self.log_freq = log_freq
        self.logger = BaseLogger()

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0  # TorchTitan's rule

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None) -> None:
        self.logger.log({"throughput(tps)": 100.0 * step}, step)


def train(dump_folder, checkpoint_step: int, last_step: int, run: str, log_freq: int = 1) -> None:
    """One run of rank 0: a trainer built (``record_losses``), resumed after ``checkpoint_step``
    (0: a fresh run), training to ``last_step``; its loss at step s is ``s + 0.25`` (run "a")
    or ``s + 0.5`` (run "b"), so the records tell the runs apart."""
    metrics = MetricsProcessor(log_freq)
    record_losses(metrics, str(dump_folder))
    for step in range(checkpoint_step + 1, last_step + 1):
        if metrics.should_log(step):  # TorchTitan's train_step, after the optimizer step
            loss = step + (0.25 if run == "a" else 0.5)
            metrics.log(step, loss, loss, 1.0)


def records(dump_folder) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (dump_folder / LOSS_FILE).read_text().splitlines())]


def test_a_run_resumed_into_its_dump_folder_leaves_one_record_per_step(tmp_path):
    train(tmp_path, 0, 6, "a")  # checkpoints at step 4, killed while writing step 7's record
    with open(tmp_path / LOSS_FILE, "a") as f:
        f.write('{"step": 7, "loss": 7.2')
    train(tmp_path, 4, 8, "b")  # resumed from step 4: trains 5-8 again
    assert records(tmp_path) == [(1, 1.25), (2, 2.25), (3, 3.25), (4, 4.25),
                                 (5, 5.5), (6, 6.5), (7, 7.5), (8, 8.5)]
    run = load_run(tmp_path)
    assert run.repeated == [] and sorted(run.losses) == list(range(1, 9))
    assert not list(tmp_path.glob("*.partial"))  # the rewrite renamed its file into place


def test_a_resume_drops_the_earlier_runs_later_records_when_logging_every_n_steps(tmp_path):
    # log_freq 2: logged 1, 2, 4, 6; resumed from step 4 it trains step 5 unlogged: the
    # earlier run's step 6 goes then, before this run logs its own.
    train(tmp_path, 0, 6, "a", log_freq=2)
    train(tmp_path, 4, 8, "b", log_freq=2)
    assert records(tmp_path) == [(1, 1.25), (2, 2.25), (4, 4.25), (6, 6.5), (8, 8.5)]


def test_a_fresh_run_into_a_used_dump_folder_starts_a_new_file(tmp_path):
    train(tmp_path, 0, 6, "a")
    train(tmp_path, 0, 3, "b")
    assert records(tmp_path) == [(1, 1.5), (2, 2.5), (3, 3.5)]


def test_a_trainer_that_stops_before_its_first_step_leaves_the_file_as_it_was(tmp_path):
    # e.g. a resume that fails to load its checkpoint: nothing trained, nothing dropped.
    train(tmp_path, 0, 4, "a")
    train(tmp_path, 4, 4, "b")
    assert records(tmp_path) == [(1, 1.25), (2, 2.25), (3, 3.25), (4, 4.25)]


def test_a_file_an_earlier_version_appended_a_resume_to_comes_out_with_one_record_per_step(tmp_path):
    train(tmp_path, 0, 6, "a")
    with open(tmp_path / LOSS_FILE, "a") as f:  # resumed from step 2 by a version that appended
        for step in range(3, 7):
            f.write(json.dumps({"step": step, "loss": step + 0.75}) + "\n")
    train(tmp_path, 4, 8, "b")  # resumed again, from step 4
    assert records(tmp_path) == [(1, 1.25), (2, 2.25), (3, 3.75), (4, 4.75),
                                 (5, 5.5), (6, 6.5), (7, 7.5), (8, 8.5)]
