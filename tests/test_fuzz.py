"""fuzz.py's targets in CI, without atheris: each on its seeds and a few thousand deterministic
mutations of them. Whatever a target lets out fails here; the long coverage-guided campaigns are
run by hand (python fuzz.py TARGET -runs=1000000)."""
import pytest

import fuzz

pytestmark = pytest.mark.slow      # 2,500 mutations a target: not in the fast loop (-m "not slow")


@pytest.mark.parametrize("name", list(fuzz.TARGETS))
def test_target_holds_on_seeds_and_mutations(name):
    target, seeds, words = fuzz.TARGETS[name]
    corpus = seeds()
    for i, data in enumerate(corpus + list(fuzz.mutations(corpus, words, 2500))):
        try:
            target(data)
        except Exception as e:               # name the input, so it can be replayed
            raise AssertionError(f"fuzz target {name}, input {i}: {data!r}") from e


def test_mutations_are_deterministic_and_varied():
    corpus = fuzz.chat_seeds("v32exp")
    a, b = list(fuzz.mutations(corpus, fuzz.markers("v32exp"), 200)), list(fuzz.mutations(corpus, fuzz.markers("v32exp"), 200))
    assert a == b and len(set(a)) > 150


def test_dictionary_file_format():
    assert fuzz.libfuzzer_dict(["<a", "｜"]) == '"\\x3c\\x61"\n"\\xef\\xbd\\x9c"\n'
