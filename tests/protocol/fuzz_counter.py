"""How many frames the fuzz tests fed to the decoder; printed in the terminal summary."""

from collections import Counter

FRAMES_TRIED: Counter = Counter()
