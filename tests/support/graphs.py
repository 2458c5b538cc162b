"""Stand-ins for a captured CUDA graph, for the graph tests on a CPU."""

BYTES_PER_TOKEN = 100  # the stand-ins' memory: a pass needs this much per token of its bucket


class EagerReplay:
    """For any StaticPass: replays by running the pass on the static buffers, as the captured
    graph would; a pass needs BYTES_PER_TOKEN per token of its bucket."""

    captured: list = []  # capture order, across instances (each stand-in class has its own)

    def warm_up(self) -> int:
        self.compute()
        return self.bucket.tokens * BYTES_PER_TOKEN

    def capture(self, pool: object) -> None:
        type(self).captured.append(self.bucket)
        self.replay()

    def replay(self) -> None:
        self.output = self.compute()


class StaleReplay(EagerReplay):
    """A replay that recomputes nothing after the capture, as an empty capture (on the wrong
    device's stream) does: every replay returns the capture's output."""

    def replay(self) -> None:
        if self.output is None:
            super().replay()
