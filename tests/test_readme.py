"""The README's commands and links: every command runs with the project's venv python, names a script
that exists and only flags that script's --help lists; every relative link and picture exists."""
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def commands():  # -> the README's shell commands: each line of its ```bash blocks, comments cut
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                yield line


@cache
def flags_of(script):  # -> the flags `script --help` lists
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{script} --help: exit {r.returncode}: {r.stderr[-300:]}"
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", r.stdout))


def python_calls():  # -> (script, its arguments) for each `.venv/bin/python SCRIPT ...` in the commands
    for line in commands():
        for part in re.split(r"&&|;", line):
            words = shlex.split(part)
            for i, w in enumerate(words):
                if w.endswith(".venv/bin/python") and i + 1 < len(words) and words[i + 1].endswith(".py"):
                    yield words[i + 1], words[i + 2:]
                if w.endswith(".venv/bin/torchrun"):
                    script = next(x for x in words[i + 1:] if x.endswith(".py"))
                    yield script, words[words.index(script) + 1:]


def test_every_command_uses_the_venv_python():
    bare = [c for c in commands() if re.search(r"(^|[\s;&|])(python3?|pip|torchrun)\s", c)]
    assert not bare, f"README commands that do not name .venv/bin/python: {bare}"
    assert len(list(python_calls())) >= 15                               # the parser found the commands


def test_every_command_names_a_script_and_flags_that_exist():
    for script, args in python_calls():
        assert (ROOT / script).is_file(), f"README runs {script}, which does not exist"
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in flags_of(script)]
        assert not unknown, f"README: {script} {' '.join(args)}: {unknown} not in its --help"


def test_every_relative_link_exists():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "no relative links found: the pattern is wrong"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_readme_is_no_development_log():
    # no commit hashes, issue numbers or run histories: those live in commit messages and bench/RESULTS.md
    assert not re.search(r"\bissue \d+", README, re.I)
    # a commit's short (7-12 hex digits) or whole (40) hash; verify's 16-digit logits hashes are output
    commit = r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![\w])"
    assert not re.search(commit, README), re.search(commit, README)


def test_python_snippets_name_checkpoints_by_absolute_paths():
    # the Python API section is for scripts outside the repository: a relative "tiny-v32" would not be found there
    calls = [c for block in re.findall(r"```python\n(.*?)```", README, re.S)
             for c in re.findall(r"(?:from_pretrained|load_tokenizer)\(\s*\"([^\"]*)\"", block)]
    assert calls, "no checkpoint named in the Python snippets: the pattern is wrong"
    assert all(c.startswith("/") for c in calls), calls


def test_the_setup_table_names_what_each_script_asks_for():
    # each script's set-up row is the one its missing-package line names (train.py asks for --torch, not --views)
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\./setup\.sh[^`]*)` \|[^|]*\|([^|]*)\|$", README, re.M)}
    assert len(rows) == 5, rows
    for script, setup in (("train.py", "./setup.sh --torch"), ("views.py", "./setup.sh --views")):
        assert setup in (ROOT / script).read_text(), script
        assert [s for s, used in rows.items() if f"`{script}`" in used] == [setup], (script, rows)
