"""Saved again at the same path (docs/design.md, "The current version of a path is what is on
disk now"): a new save written over a recorded version is not taken for complete while the old
version's last file is still the old one, and the path says loudly that it changed."""
from __future__ import annotations

from pipeline.core.layouts import Entry, FileFacts, FileFormat, resave_in_progress


def facts(rel: str, size: int, ns: int, fmt: str = FileFormat.OTHER, names: tuple[str, ...] = ()) -> FileFacts:
    return FileFacts(rel, size, ns, fmt, names=names)


def recorded(entry: Entry) -> dict[str, tuple[int, int]]:
    return {f.relpath: (f.size, f.mtime_ns) for f in entry.files}


def test_a_trainer_folder_saved_again_waits_for_its_new_trainer_state():
    old = Entry("checkpoint-4", True, (facts("model.safetensors", 10, 1), facts("trainer_state.json", 5, 2)))
    half = Entry("checkpoint-4", True, (facts("model.safetensors", 12, 3), facts("trainer_state.json", 5, 2)))
    done = Entry("checkpoint-4", True, (facts("model.safetensors", 12, 3), facts("trainer_state.json", 6, 4)))
    assert resave_in_progress(old, recorded(old)) is None  # nothing changed
    why = resave_in_progress(half, recorded(old))
    assert why is not None and "model.safetensors changed" in why and "trainer_state.json" in why
    assert resave_in_progress(done, recorded(old)) is None
    assert resave_in_progress(half, {}) is None  # nothing recorded there: the layout rule decides


def test_dcp_rank_files_rewritten_under_the_old_metadata_are_in_progress():
    meta = facts(".metadata", 100, 1, FileFormat.DCP_METADATA, names=("__0_0.distcp",))
    old = Entry("step_2", True, (meta, facts("__0_0.distcp", 50, 1)))
    half = Entry("step_2", True, (meta, facts("__0_0.distcp", 50, 9)))
    assert "writes last" in resave_in_progress(half, recorded(old))
    new_meta = facts(".metadata", 100, 10, FileFormat.DCP_METADATA, names=("__0_0.distcp",))
    assert resave_in_progress(Entry("step_2", True, (new_meta, facts("__0_0.distcp", 50, 9))), recorded(old)) is None


def test_a_stale_index_is_not_the_last_file_of_an_unsharded_save_over_a_sharded_one():
    index = facts("model.safetensors.index.json", 30, 1, FileFormat.JSON,
                  names=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    old = Entry("final", True, (facts("config.json", 3, 1), index,
                                facts("model-00001-of-00002.safetensors", 10, 1),
                                facts("model-00002-of-00002.safetensors", 10, 1)))
    # transformers deletes the old shards but leaves the index: the new save is complete.
    new = Entry("final", True, (facts("config.json", 3, 5), index, facts("model.safetensors", 20, 5)))
    assert resave_in_progress(new, recorded(old)) is None
    # Sharded again, the index still the old one while the shards are rewritten: in progress.
    half = Entry("final", True, (facts("config.json", 3, 5), index,
                                 facts("model-00001-of-00002.safetensors", 10, 6),
                                 facts("model-00002-of-00002.safetensors", 10, 6)))
    assert "index.json" in resave_in_progress(half, recorded(old))


def test_a_single_file_has_no_last_file_rule():
    old = Entry("step_1.safetensors", False, (facts("", 10, 1, FileFormat.SAFETENSORS),))
    assert resave_in_progress(Entry("step_1.safetensors", False, (facts("", 12, 2, FileFormat.SAFETENSORS),)),
                              recorded(old)) is None
