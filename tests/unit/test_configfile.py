"""Editing config.toml as text (pipeline/configfile.py): a ``[[targets]]`` table appended loads as
the target it says, a removed one takes only its own lines, and every other byte (comments,
other tables, layout) stays; an edit whose result would not parse as intended is refused."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeline import configfile
from pipeline.errors import ConfigError
from pipeline.objectstore.config import _NAME, parse_targets, target_from
from pipeline.settings import read_config

WHERE = Path("/h/config.toml")

FILES = [
    "",
    "rf = 2\n",
    "rf = 2",  # no final newline
    "# top comment\nrf = 2  # two copies\n\n[runs.\"x/*\"]\nkeep_last = 3\n",
    '[[targets]]\nname = "old"  # kept\nurl = "s3://old-bucket/p"\n\n# about what follows\n[roots."/data"]\n'
    'quiet_seconds = 5\n',
    '[[targets]]\r\nname = "crlf"\r\nurl = "s3://crlf-bucket"\r\n',
    'note = """\n[[targets]] is text here\n"""\n',
]


def data_of(text: str) -> dict:
    return read_config(text, WHERE)


def table_for(name: str, prefix: str, profile: str) -> dict:
    """A [[targets]] table as `ckpt target add` writes it (url normalized by the loader)."""
    table = {"name": name, "url": f"s3://ckpt-bucket/{prefix}", "profile": profile}
    table["url"] = target_from(table, "test").url
    return table


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.sampled_from([f for f in FILES if "note" not in f]),
       name=st.from_regex(_NAME, fullmatch=True),
       prefix=st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
       profile=st.text(st.characters(exclude_categories=("Cs",)), max_size=20))
def test_an_appended_table_loads_as_its_target_and_removing_it_gives_the_file_back(text, name, prefix, profile):
    try:
        table = table_for(name, prefix, profile)
    except ConfigError:
        assume(False)  # not a url the loader takes (a '#', a '?', an empty component): add refuses it too
    data = data_of(text)
    assume(name not in {t["name"] for t in data.get("targets", [])})
    new = configfile.appended(text, data, "targets", table, WHERE)
    assert new.startswith(text)  # every byte there was, is still there
    loaded = parse_targets(data_of(new)["targets"], str(WHERE))
    assert loaded[-1] == target_from(table, "test")
    assert loaded[-1].prefix == target_from({"name": "x", "url": table["url"]}, "t").prefix
    again = configfile.removed(new, data_of(new), "targets", len(loaded) - 1, WHERE)
    assert again == (text if not text or text.endswith("\n") else text + "\n")


def test_removing_a_middle_table_takes_only_its_lines():
    text = ("# my settings\n"
            "rf = 2\n"
            "\n"
            "[[targets]]\n"
            'name = "a"\n'
            'url = "s3://bucket-a"\n'
            "\n"
            "# b: the old archive, going away\n"
            "[[targets]]\n"
            'name = "b"      # comment on b\n'
            "# inside b\n"
            'url = "s3://bucket-b/x"\n'
            "# about c, after b\n"
            "\n"
            "[[targets]]\n"
            'name = "c"\n'
            'url = "s3://bucket-c"\n'
            "# the end\n")
    new = configfile.removed(text, data_of(text), "targets", 1, WHERE)
    assert new == text.replace("[[targets]]\n"
                               'name = "b"      # comment on b\n'
                               "# inside b\n"
                               'url = "s3://bucket-b/x"\n', "")
    assert [t["name"] for t in data_of(new)["targets"]] == ["a", "c"]


def test_removing_the_only_table_removes_the_key_and_its_blank_line():
    text = 'rf = 2\n\n[[targets]]\nname = "a"\nurl = "s3://bucket-a"\n\n[runs."r"]\nkeep_last = 1\n'
    new = configfile.removed(text, data_of(text), "targets", 0, WHERE)
    assert new == 'rf = 2\n\n[runs."r"]\nkeep_last = 1\n'
    assert "targets" not in data_of(new)


def test_an_inline_targets_array_cannot_be_edited_as_lines_and_is_refused():
    text = 'targets = [{name = "a", url = "s3://bucket-a"}]\n'
    with pytest.raises(ConfigError, match="by hand"):
        configfile.removed(text, data_of(text), "targets", 0, WHERE)
    with pytest.raises(ConfigError, match="by hand"):
        configfile.appended(text, data_of(text), "targets", table_for("b", "", ""), WHERE)


def test_a_header_inside_a_multiline_string_is_not_taken_for_a_table():
    text = 'note = """\n[[targets]]\n"""\n\n[[targets]]\nname = "a"\nurl = "s3://bucket-a"\n'
    with pytest.raises(ConfigError, match="by hand"):
        configfile.removed(text, data_of(text), "targets", 0, WHERE)


def test_a_cut_that_parses_to_other_data_is_refused():
    """The one header line is inside a string and the real table's header is quoted: the line
    count agrees, the cut parses, but to other data than the file without that table."""
    text = '[["targets"]]\nname = "a"\nurl = "s3://bucket-a"\nnote = """\n[[targets]]\n[end"""\n'
    with pytest.raises(ConfigError, match="by hand"):
        configfile.removed(text, data_of(text), "targets", 0, WHERE)


def test_a_new_file_is_private_and_an_existing_one_keeps_its_mode(tmp_path):
    new = tmp_path / "config.toml"
    configfile.write(new, "rf = 2\n")
    assert new.stat().st_mode & 0o777 == 0o600
    new.chmod(0o640)
    configfile.write(new, "rf = 3\n")
    assert new.stat().st_mode & 0o777 == 0o640 and new.read_text() == "rf = 3\n"


def test_a_config_kept_elsewhere_through_a_link_is_edited_there(tmp_path):
    real = tmp_path / "dotfiles" / "ckpt.toml"
    real.parent.mkdir()
    real.write_text("rf = 2\n")
    link = tmp_path / "config.toml"
    os.symlink(real, link)
    configfile.write(link, "rf = 3\n")
    assert link.is_symlink() and real.read_text() == "rf = 3\n"


def test_a_file_that_does_not_parse_is_named_with_its_line(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("rf = 2\nkeep_last = = 3\n")
    with pytest.raises(ConfigError, match=r"config.toml: .*line 2"):
        configfile.read(path)
