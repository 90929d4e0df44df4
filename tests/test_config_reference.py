"""The docs' config reference (docs/reference/config.md) is generated from the config dataclasses and kept in sync."""

import dataclasses

from podtrain import config
from podtrain.config_reference import BEGIN, END, field_docs, reference_table, replace_in


def test_the_config_reference_page_holds_every_row_of_the_generated_table(repo):
    page = (repo / "docs/reference/config.md").read_text()
    header, rule, *rows = reference_table().splitlines()
    stale = [row for row in rows if row not in page.splitlines()]
    assert not stale and page.count(header) == len(dataclasses.fields(config.RunConfig)), \
        f"docs/reference/config.md is stale ({len(stale)} rows differ): run `python -m podtrain.docs_gen`"


def test_every_config_key_has_a_row_with_its_default_and_docstring():
    table = reference_table()
    for section in dataclasses.fields(config.RunConfig):
        cls = section.default_factory
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section.name}.{f.name} has no docstring in config.py"
            assert f"| `{section.name}.{f.name}` |" in table
    assert "| `ckpt.signals` | `[SIGTERM, SIGINT, SIGUSR1]` |" in table
    assert "| `model.vocab_size` | `null` |" in table and "| `train.compile` | `false` |" in table


def test_replace_in_rewrites_only_between_the_markers():
    text = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert replace_in(text, "new") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
    assert replace_in(replace_in(text, "new"), "new") == replace_in(text, "new")
