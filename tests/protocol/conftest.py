"""Protocol tests: report how many fuzz frames were tried."""

from fuzz_counter import FRAMES_TRIED


def pytest_terminal_summary(terminalreporter):
    if FRAMES_TRIED:
        parts = ", ".join(f"{name} {count}" for name, count in sorted(FRAMES_TRIED.items()))
        terminalreporter.write_line(
            f"protocol fuzz: {sum(FRAMES_TRIED.values())} frames tried ({parts}); "
            f"only ProtocolError escaped decode()"
        )
