"""The tuning cache (a JSON file of tuned points per layer key), its lookup
rules, and the [uniep] tuning switches that decide what training uses."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import pickle
import shutil
import textwrap
from types import SimpleNamespace

import pytest
from torchtitan_release import torchtitan_0_2
import torch

from titan_uniep.config import UniEP
from titan_uniep.params import default_params
from titan_uniep.tuning import cache, selection
from titan_uniep.tuning.cache import CacheEntry, CacheKey, load, lookup, save, token_bucket

KEY = CacheKey(gpu="NVIDIA H200", ep_size=2, dtype="bfloat16", token_bucket=8192, dim=2048, hidden=768,
               num_experts=128, top_k=8, score_before_experts=False, kernel_version="0123456789abcdef")
FORWARD = {"fc2_block_n": 256, "dispatch_programs": 32, "local_first": True}
BACKWARD = {"da_num_warps": 8, "dh_programs_per_sm": 1}


def _entry(key=KEY, forward=FORWARD, backward=BACKWARD):
    return CacheEntry(key=key, forward=dict(forward), backward=dict(backward),
                      measured_ms={"forward": {"default": 1.91, "tuned": 1.74},
                                   "backward": {"default": 4.2, "tuned": 4.0}},
                      predicted_ms={"forward": {"default": 1.8, "tuned": 1.7},
                                    "backward": {"default": 4.1, "tuned": 3.9}},
                      tokens=8000, candidates=9, date="2026-12-01")


def test_cache_round_trips_through_readable_json_and_merges(tmp_path):
    path = tmp_path / "new_folder" / "tuning.json"
    other = _entry(dataclasses.replace(KEY, hidden=1536), forward={"fc1_num_stages": 4}, backward={})
    save(path, [_entry()])
    save(path, [other])  # merged into the file, not replacing it
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == ("titan_uniep tuning cache", 2)
    assert [e["key"]["hidden"] for e in data["entries"]] == [768, 1536]
    assert data["entries"][0]["forward"] == FORWARD and data["entries"][0]["key"]["gpu"] == "NVIDIA H200"
    assert path.read_text().count("\n") > 20, "indented for people to read"
    assert load(path) == [_entry(), other]

    base = default_params(2, hidden=768)
    params, reason = lookup(load(path), KEY, "forward")
    assert params == base.replace(**FORWARD) and "1.910 -> 1.740" in reason
    params, _ = lookup(load(path), KEY, "backward")
    assert params == base.replace(**BACKWARD)
    params, _ = lookup(load(path), other.key, "backward")
    assert params == default_params(2, hidden=1536), "an empty change set is the default, and a hit"

    save(path, [_entry(forward={"fc2_block_n": 128})])  # the same key: replaced
    entries = load(path)
    assert len(entries) == 2 and lookup(entries, KEY, "forward")[0] == base.replace(fc2_block_n=128)


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA A100-SXM4-80GB"), ("ep_size", 4),
                                         ("kernel_version", "fedcba9876543210")])
def test_entry_of_another_gpu_ep_size_or_kernel_version_is_refused_naming_it(field, value):
    here = dataclasses.replace(KEY, **{field: value})
    params, reason = lookup([_entry()], here, "forward")
    assert params is None
    assert f"{field} {getattr(KEY, field)!r} (here {value!r})" in reason, reason
    assert "Retune" in reason
    other_fields = {"gpu", "ep_size", "kernel_version"} - {field}
    assert not any(f"{f} " in reason.split("another")[1] for f in other_fields), reason


def test_shape_without_entry_says_so():
    params, reason = lookup([_entry()], dataclasses.replace(KEY, top_k=4), "forward")
    assert params is None and reason.startswith("no tuned entry for") and "K=4" in reason


def test_entry_of_the_other_score_mode_does_not_apply():
    """Scores before the experts compile other kernels (and fc1's two-product
    tile): a point tuned in one score mode is not the other's."""
    before = dataclasses.replace(KEY, score_before_experts=True)
    params, reason = lookup([_entry()], before, "forward")
    assert params is None and reason.startswith("no tuned entry for") and "scores before the experts" in reason
    assert lookup([_entry(), _entry(before, forward={"fc2_block_n": 128})], before, "forward")[0] == \
        default_params(2, hidden=768).replace(fc2_block_n=128)


def test_token_counts_share_a_bucket_of_4096():
    assert [token_bucket(t) for t in (0, 1, 4096, 4097, 6000, 8192, 8193)] == [4096, 4096, 4096, 8192, 8192, 8192,
                                                                             12288]

    def key(tokens):
        return CacheKey.for_layer(gpu=KEY.gpu, ep_size=2, dtype="bfloat16", num_tokens=tokens, dim=2048, hidden=768,
                                  num_experts=128, top_k=8, score_before_experts=False, version=KEY.kernel_version)

    assert key(6000) == KEY and key(4097) == KEY
    assert lookup([_entry()], key(6000), "forward")[0] is not None
    assert lookup([_entry()], key(8193), "forward")[0] is None
    assert lookup([_entry()], key(4096), "forward")[0] is None


def test_cache_is_json_only_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return pathlib.Path.touch, (marker,)

    evil = tmp_path / "evil.json"
    evil.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match="is not JSON"):
        load(evil)
    assert not marker.exists()
    (tmp_path / "v1.json").write_text(json.dumps({"format": cache.CACHE_FORMAT, "version": 1, "entries": []}))
    with pytest.raises(ValueError, match="has version 1, this titan_uniep reads version 2: retune"):
        load(tmp_path / "v1.json")
    (tmp_path / "other.json").write_text(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match="is not a 'titan_uniep tuning cache' file"):
        load(tmp_path / "other.json")
    assert load(tmp_path / "missing.json") == []


@pytest.mark.parametrize("name,content", [
    ("hostname", b"gpu-node-7\n"),  # the report: --uniep.tuning_cache /etc/hostname
    ("latin1.txt", b"caf\xe9\n"),
    ("list.json", b"[1, 2]"),
    ("other_tool.json", json.dumps({"format": "another tool", "version": 2, "entries": []}).encode()),
])
def test_a_file_titan_uniep_did_not_write_is_left_alone_and_the_option_named(tmp_path, name, content):
    """Before: "is not JSON (...); delete it or point to another file", for any file the path named."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        load(path)
    message = str(err.value)
    assert message.startswith(f"tuning cache {path} is not "), message
    assert ("so titan_uniep did not write it (its tuning caches are JSON objects with \"format\": \"titan_uniep "
            "tuning cache\"): leave it as it is and name another file for the cache (--uniep.tuning_cache PATH, or "
            "--cache PATH of titan_uniep.tools.tune)") in message, message
    assert "delet" not in message, message
    assert path.read_bytes() == content


@pytest.mark.parametrize("data,problem", [
    ({"version": 1, "entries": []}, "has version 1, this titan_uniep reads version 2: retune"),
    ({"version": cache.CACHE_VERSION, "entries": {}}, ": 'entries' must be a list"),
    ({"version": cache.CACHE_VERSION, "entries": [{"key": {}}]}, ", entry 0: key fields [] are not"),
])
def test_only_a_file_recognisably_our_cache_is_advised_for_deletion(tmp_path, data, problem):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"format": cache.CACHE_FORMAT, **data}))
    with pytest.raises(ValueError) as err:
        load(path)
    message = str(err.value)
    assert message.startswith(f"tuning cache {path}{problem}" if problem.startswith((":", ","))
                              else f"tuning cache {path} {problem}"), message
    assert "delete" in message and "a titan_uniep tuning cache, whose entries the tuner measures again" in message, \
        message


def test_entry_that_does_not_fit_layer_params_is_refused():
    for changes in ({"no_such_field": 1}, {"block_m": 100}):
        params, reason = lookup([_entry(forward=changes)], KEY, "forward")
        assert params is None and "does not fit this LayerParams" in reason, reason


def test_kernel_version_follows_the_kernel_and_runtime_sources(tmp_path):
    package = pathlib.Path(cache.__file__).resolve().parents[1]
    for sub in ("kernels", "runtime"):
        (tmp_path / sub).mkdir()
        for path in (package / sub).glob("*.py"):
            shutil.copy(path, tmp_path / sub / path.name)
    shutil.copy(package / "params.py", tmp_path / "params.py")
    (tmp_path / "bench.py").write_text("# not a kernel source\n")
    before = cache.source_digest(tmp_path, "3.6.0")
    assert before == cache.source_digest(package, "3.6.0"), "the digest reads the files, not the folder's path"
    kernel = tmp_path / "kernels" / "fc2_combine.py"
    text = kernel.read_text()
    kernel.write_text(text + "\n# an edit\n")
    assert cache.source_digest(tmp_path, "3.6.0") != before
    kernel.write_text(text)
    (tmp_path / "bench.py").write_text("# edited\n")
    assert cache.source_digest(tmp_path, "3.6.0") == before
    assert cache.source_digest(tmp_path, "3.7.0") != before
    assert len(cache.kernel_version()) == 16


def test_cached_policy_warns_once_per_missing_shape(caplog):
    policy = selection.TuningPolicy(mode="cached", cache_path="tuning.json", entries=[_entry()])
    missing = dataclasses.replace(KEY, dim=4096)
    foreign = dataclasses.replace(KEY, gpu="NVIDIA B200")
    with caplog.at_level(logging.INFO, logger="titan_uniep.tuning.selection"):
        assert policy.params_for(KEY, "forward") == default_params(2, hidden=768).replace(**FORWARD)
        for direction in ("forward", "backward", "forward"):
            assert policy.params_for(missing, direction) is None
        assert policy.params_for(foreign, "backward") is None
        assert policy.params_for(foreign, "forward") is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert "no tuned entry for" in warned[0] and "D=4096" in warned[0]
    assert "gpu 'NVIDIA H200' (here 'NVIDIA B200')" in warned[1]
    caplog.clear()
    off = selection.TuningPolicy(mode="off", cache_path="", entries=[_entry()])
    assert off.params_for(KEY, "forward") is None and not caplog.records


def test_missing_cache_file_runs_the_defaults_with_one_warning_per_shape(tmp_path, caplog):
    policy = selection.TuningPolicy.from_config("cached", str(tmp_path / "missing.json"))
    assert policy.entries == []
    other_shape = dataclasses.replace(KEY, dim=4096)
    with caplog.at_level(logging.WARNING, logger="titan_uniep.tuning.selection"):
        for key in (KEY, other_shape, KEY):
            for direction in ("forward", "backward"):
                assert policy.params_for(key, direction) is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    for message, key in zip(warned, (KEY, other_shape)):
        assert f"no tuned entry for {key.describe()}: the tuning cache does not exist" in message, message
        assert "missing.json" in message and message.endswith("using the default parameters"), message


def test_unreadable_or_foreign_cache_file_is_an_error_naming_the_key(tmp_path):
    fix = r"\. Set \[uniep\] tuning_cache to a file written by `python -m titan_uniep\.tools\.tune`"
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"\[uniep\] tuning_cache: tuning cache .*broken\.json is not JSON.*" + fix):
        selection.TuningPolicy.from_config("search", str(tmp_path / "broken.json"))
    (tmp_path / "foreign.json").write_text('{"format": "another tool", "entries": []}')
    with pytest.raises(ValueError, match=r"foreign\.json is not a 'titan_uniep tuning cache' file.*" + fix):
        selection.TuningPolicy.from_config("cached", str(tmp_path / "foreign.json"))
    with pytest.raises(ValueError, match=r"tuning cache .* cannot be read \(Is a directory\)" + fix):
        selection.TuningPolicy.from_config("cached", str(tmp_path))
    save(tmp_path / "ok.json", [_entry()])
    assert selection.TuningPolicy.from_config("cached", str(tmp_path / "ok.json")).entries == [_entry()]
    assert selection.TuningPolicy.from_config("search", str(tmp_path / "new.json")).entries == []


def test_ranks_that_chose_different_points_raise(monkeypatch):
    group = SimpleNamespace(group_name="ep")
    tuned = default_params(2, hidden=768).replace(**FORWARD)
    monkeypatch.setattr(selection.dist, "all_reduce", lambda tensor, op, group: None)  # every rank agrees
    selection.check_agreement(group, tuned, "cpu", "tuning.json")

    def another_rank_has_the_default(tensor, op, group):
        tensor[1] = max(int(tensor[1]), -selection.params_digest(None))

    monkeypatch.setattr(selection.dist, "all_reduce", another_rank_has_the_default)
    with pytest.raises(RuntimeError, match=r"EP group 'ep' chose different parameter points.*same \[uniep\] "
                                           r"tuning_cache"):
        selection.check_agreement(group, tuned, "cpu", "tuning.json")
    assert selection.params_digest(tuned) != selection.params_digest(default_params(2, hidden=768)) != 0


def test_workspace_build_gets_the_entry_of_its_layer_key(monkeypatch):
    """What the op's workspace_for asks: the group's policy, at the layer's tokens (bucketed) and EP size."""
    group = SimpleNamespace(group_name="ep-tuning-test")
    entry = _entry(dataclasses.replace(KEY, kernel_version=cache.kernel_version()))
    monkeypatch.setattr(selection.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(selection.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(selection.dist, "all_reduce", lambda tensor, op, group: None)
    layer = dict(num_tokens=6000, dim=2048, hidden=768, num_experts=128, top_k=8, score_before_experts=False,
                 dtype=torch.bfloat16, device="cpu")
    assert selection.select_params(group, **layer, backward=False) is None, "no policy: the default"
    monkeypatch.setitem(selection._policies, group.group_name,
                        selection.TuningPolicy(mode="cached", cache_path="t.json", entries=[entry]))
    base = default_params(2, hidden=768)
    assert selection.select_params(group, **layer, backward=False) == base.replace(**FORWARD)
    assert selection.select_params(group, **layer, backward=True) == base.replace(**BACKWARD)
    assert selection.select_params(group, **{**layer, "num_tokens": 9000}, backward=False) is None
    monkeypatch.setitem(selection._policies, group.group_name,
                        selection.TuningPolicy(mode="off", cache_path="", entries=[entry]))
    assert selection.select_params(group, **layer, backward=False) is None


HEADER = """
[job]
custom_config_module = "titan_uniep.config"
[experimental]
custom_import = "titan_uniep.torchtitan.v0_2"
[model]
name = "deepseek_v3_uniep"
flavor = "debugmodel"
[uniep]
"""


@pytest.mark.parametrize("lines,match", [
    ('tuning = "fast"', r"\[uniep\] tuning = 'fast' is not a tuning mode; use one of 'off', 'cached', 'search'"),
    ('tuning = "cached"', r"\[uniep\] tuning = 'cached' tunes UniEP's kernels, but schedule = \"reference\" runs "
                          r"none\. Set schedule = \"fused\""),
    ('tuning = "search"\nschedule = "fused"\ntuning_cache = 3', r"\[uniep\] tuning_cache must be a file path"),
])
@torchtitan_0_2  # a TorchTitan 0.2.2 TOML through its config manager
def test_tuning_keys_are_validated_with_the_fix(tmp_path, lines, match):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(HEADER) + lines + "\n")
    with pytest.raises(ValueError, match=match):
        ConfigManager().parse_args(["--job.config_file", str(path)])


def test_tuning_defaults_to_off_and_parses():
    assert (UniEP().tuning, UniEP().tuning_cache) == ("off", "")
    cfg = UniEP(enable=True, schedule="fused", tuning="cached", tuning_cache="/tmp/t.json")
    assert (cfg.tuning, cfg.tuning_cache) == ("cached", "/tmp/t.json")
    assert cache.default_cache_path().endswith("titan_uniep/tuning.json")


def test_the_start_up_search_tunes_each_shape_with_the_jobs_weight_gradient_dtype(tmp_path, monkeypatch):
    """``tuning = "search"``: each distinct MoE shape is searched once, with the
    weight gradients' dtype the job writes (the hook's
    ``compute_dtype.job_weight_grad_dtype``), and the policy is registered."""
    from titan_uniep.tuning import search

    searched = []
    monkeypatch.setattr(selection, "_policies", {})
    monkeypatch.setattr(search, "search_layer", lambda group, layer, options: searched.append(layer)
                        or search.SearchResult(layer, None))
    monkeypatch.setattr(selection.dist, "get_rank", lambda group=None: 0)

    def moe(hidden):
        return SimpleNamespace(experts=SimpleNamespace(w1=torch.empty(8, hidden, 64, device="meta")),
                               router=SimpleNamespace(top_k=2), score_before_experts=False)

    group = SimpleNamespace(group_name="search-test")
    for grads in (torch.float32, None):
        searched.clear()
        policy = selection.configure_tuning(group, "search", str(tmp_path / "tuning.json"),
                                            moe_modules=[moe(96), moe(96), moe(32)], num_tokens=300,
                                            dtype=torch.bfloat16, weight_grad_dtype=grads)
        assert [(l.hidden, l.tokens, l.dtype, l.weight_grad_dtype) for l in searched] == [
            (96, 300, torch.bfloat16, grads), (32, 300, torch.bfloat16, grads)]
        assert selection.policy_for("search-test") is policy and policy.entries == []


def test_an_entry_records_the_weight_gradients_dtype_and_entries_without_it_still_load(tmp_path):
    path = tmp_path / "tuning.json"
    save(path, [dataclasses.replace(_entry(), weight_grad_dtype="float32")])
    assert json.loads(path.read_text())["entries"][0]["weight_grad_dtype"] == "float32"
    assert load(path)[0].weight_grad_dtype == "float32"
    data = json.loads(path.read_text())
    del data["entries"][0]["weight_grad_dtype"]  # written before the field existed
    path.write_text(json.dumps(data))
    (entry,) = load(path)
    assert entry.weight_grad_dtype == "" and lookup([entry], KEY, "forward")[0] is not None
