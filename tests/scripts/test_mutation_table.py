"""scripts/mutation_test.py's mutants stay applicable: each one's snippet occurs exactly once in the file its
path names (``locate``, as the script finds it; a code change that moves or rewrites a snippet shows up here,
not months later as a mutant that can no longer be planted), and each names tests that exist."""

from __future__ import annotations

from pathlib import Path

from fixtures import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutant_applies_once_to_its_file_and_names_real_tests():
    mutation = load_script("scripts/mutation_test.py")
    assert len(mutation.MUTANTS) >= 20
    for m in mutation.MUTANTS:
        assert mutation.locate(m, ROOT) == ROOT / m.path, f"{m.id}: its snippet is not once in {m.path}"
        assert m.original != m.replacement, m.id
        for test in m.tests:
            file, _, name = test.partition("::")
            path = ROOT / file
            assert path.exists(), f"{m.id}: no test file {file}"
            if name:
                assert f"def {name.split('[')[0]}(" in path.read_text(), f"{m.id}: no test {test}"
