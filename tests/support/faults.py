"""The faults the fault tests inject (in-process, and in a real TorchServe worker through
EMBEDSERVE_TEST_FAULTS), the texts they send, and their answers in-process."""

import json

from embedserve.handler.service import RawRequest
from tests.support.engines import TEXTS

# The tiny model truncates at 48 tokens. Passes over 40 padded tokens "run out of memory": short
# texts fit after splitting, a 48-token input never fits, even alone.
OOM_ABOVE = 40
LONG = TEXTS[3]
SHORT = ["hello world", "the cat sat on the mat", "one two three", "a", "b c d", "hello", "cat mat", "world"]
POISON_TOKEN = 7


def answers(engine, bodies, url_path=""):
    responses, report = engine.handle_with_report([RawRequest(json.dumps(b).encode(), None, url_path) for b in bodies])
    return [(r.status, json.loads(r.body)) for r in responses], report
