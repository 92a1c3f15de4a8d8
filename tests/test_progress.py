"""Progress output: one line per interval in a log file, never carriage returns."""
import io

from vitlab.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_log_file_gets_whole_lines_at_most_once_per_interval():
    out = io.StringIO()
    with Progress(total=1000, file=out, desc="decoding", mininterval=3600) as bar:
        for _ in range(1000):
            bar.update(1)
        Progress.write("a message", file=out)  # tqdm.write must not add bar lines in between
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert all(line.strip() for line in lines)
    bar_lines = [line for line in lines if line.startswith("decoding")]
    assert len(bar_lines) == 2, lines  # the first (0%) and the final state only
    assert "1000/1000" in bar_lines[-1]
    assert "a message" in lines


def test_log_file_prints_again_after_the_interval():
    out = io.StringIO()
    with Progress(total=10, file=out, desc="x", mininterval=0) as bar:
        for _ in range(10):
            bar.update(1)
    bar_lines = [line for line in out.getvalue().splitlines() if line.startswith("x")]
    assert len(bar_lines) >= 10


def test_log_file_prints_the_final_state_once():
    """When the last update already printed the final count, closing does not print it again."""
    out = io.StringIO()
    with Progress(total=3, file=out, desc="runs", mininterval=0) as bar:
        for _ in range(3):
            bar.update(1)
    finals = [line for line in out.getvalue().splitlines() if "3/3" in line]
    assert len(finals) == 1, out.getvalue()
    out = io.StringIO()
    with Progress(total=3, file=out, desc="runs", mininterval=3600) as bar:  # a final state not yet printed
        bar.update(3)
    assert sum("3/3" in line for line in out.getvalue().splitlines()) == 1


def test_terminal_keeps_the_live_bar():
    out = FakeTerminal()
    with Progress(total=5, file=out, desc="t", mininterval=0) as bar:
        for _ in range(5):
            bar.update(1)
    assert "\r" in out.getvalue()


def test_goto_moves_to_a_count_and_never_past_total():
    out = io.StringIO()
    bar = Progress(total=60, file=out, mininterval=3600)
    bar.goto(12.7)
    assert bar.n == 12
    bar.goto(5)  # never backwards
    assert bar.n == 12
    bar.goto(99)
    assert bar.n == 60
    bar.close()
    assert out.getvalue().count("\n") == 2
