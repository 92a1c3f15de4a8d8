"""Progress output: one line per interval in a log file, never carriage returns; time from an injected clock."""
import io

from vitlab.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def bar_lines(out: io.StringIO, desc: str) -> list[str]:
    return [line for line in out.getvalue().splitlines() if line.startswith(desc)]


def test_log_file_gets_whole_lines_at_most_once_per_interval():
    out, clock = io.StringIO(), Clock()
    with Progress(total=1000, file=out, desc="decoding", mininterval=3600, clock=clock) as bar:
        for _ in range(1000):
            clock.now += 1.0  # 1000 s in all: less than one interval
            bar.update(1)
        Progress.write("a message", file=out)  # tqdm.write must not add bar lines in between
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert all(line.strip() for line in lines)
    assert len(bar_lines(out, "decoding")) == 2, lines  # the first (0%) and the final state only
    assert "1000/1000" in bar_lines(out, "decoding")[-1]
    assert "a message" in lines


def test_log_file_prints_again_once_each_interval_has_passed():
    out, clock = io.StringIO(), Clock()
    with Progress(total=10, file=out, desc="x", mininterval=30, clock=clock) as bar:
        for _ in range(10):
            clock.now += 10.0
            bar.update(1)
    counts = [line.split("|")[2].split()[0] for line in bar_lines(out, "x")]
    assert counts == ["0/10", "3/10", "6/10", "9/10", "10/10"]  # at 0, 30, 60 and 90 s, and the end


def test_eta_and_rate_come_from_the_clock():
    out, clock = io.StringIO(), Clock()
    bar = Progress(total=10, file=out, desc="y", mininterval=30, clock=clock, smoothing=0, unit="img")
    clock.now += 8.0
    bar.update(4)
    assert "4/10 [00:08<00:12,  2.00s/img]" in str(bar)  # 2 s per image so far, 6 to go
    clock.now += 32.0
    bar.update(1)
    assert "5/10 [00:40<00:40,  8.00s/img]" in str(bar)
    bar.close()
    assert [line.split("|")[2].strip() for line in bar_lines(out, "y")] == [
        "0/10 [00:00<?, ?img/s]", "5/10 [00:40<00:40,  8.00s/img]"]  # no line at 8 s (< 30 s); none more on close


def test_log_file_prints_the_final_state_once():
    """When the last update already printed the final count, closing does not print it again."""
    out, clock = io.StringIO(), Clock()
    with Progress(total=3, file=out, desc="runs", mininterval=0, clock=clock) as bar:
        for _ in range(3):
            clock.now += 1.0
            bar.update(1)
    finals = [line for line in out.getvalue().splitlines() if "3/3" in line]
    assert len(finals) == 1, out.getvalue()
    out = io.StringIO()
    with Progress(total=3, file=out, desc="runs", mininterval=3600, clock=clock) as bar:  # final state not yet printed
        bar.update(3)
    assert sum("3/3" in line for line in out.getvalue().splitlines()) == 1


def test_terminal_keeps_the_live_bar():
    out, clock = FakeTerminal(), Clock()
    with Progress(total=5, file=out, desc="t", mininterval=0, clock=clock) as bar:
        for _ in range(5):
            clock.now += 1.0
            bar.update(1)
    assert "\r" in out.getvalue()


def test_goto_moves_to_a_count_and_never_past_total():
    out = io.StringIO()
    bar = Progress(total=60, file=out, mininterval=3600, clock=Clock())
    bar.goto(12.7)
    assert bar.n == 12
    bar.goto(5)  # never backwards
    assert bar.n == 12
    bar.goto(99)
    assert bar.n == 60
    bar.close()
    assert out.getvalue().count("\n") == 2
