"""SharedWatches' bookkeeping against a client that records what it is asked: a key
range is watched once however many read it, cancelled with its last reader, armed
anew once lost, and a reader that joins as its watch is lost is told of the loss
(the race that taking a lock on pyetcd's thread would turn into a deadlock)."""
from bamboo.control import changes
from bamboo.control.changes import SharedWatch, SharedWatches


class RecordingClient:
    def __init__(self):
        self.armed: list[tuple[str, str]] = []
        self.callbacks: dict[int, object] = {}
        self.cancelled: list[int] = []

    def add_watch_callback(self, key, callback, range_end=None):
        self.armed.append((key, range_end))
        self.callbacks[len(self.armed)] = callback
        return len(self.armed)

    def cancel_watch(self, watch):
        self.cancelled.append(watch)


def test_one_watch_per_range_cancelled_with_its_last_reader():
    client = RecordingClient()
    hub = SharedWatches(client)
    seen = {name: [] for name in "abc"}
    a = hub.read("f/", "f0", seen["a"].append)
    b = hub.read("f/", "f0", seen["b"].append)
    hub.read("g/", "g0", seen["c"].append)
    assert client.armed == [("f/", "f0"), ("g/", "g0")]
    client.callbacks[1]("event")
    assert seen == {"a": ["event"], "b": ["event"], "c": []}
    hub.stop(a)
    client.callbacks[1]("later")
    assert seen["a"] == ["event"] and seen["b"] == ["event", "later"]
    assert client.cancelled == []
    hub.stop(b)
    assert client.cancelled == [1]
    hub.read("f/", "f0", seen["a"].append)
    assert client.armed[-1] == ("f/", "f0") and len(client.armed) == 3


def test_a_lost_watch_is_armed_anew_and_never_cancelled():
    client = RecordingClient()
    hub = SharedWatches(client)
    told = []
    first = hub.read("f/", "f0", told.append)
    client.callbacks[1](None)  # the stream ended: pyetcd forgot the watch
    assert told == [None]
    again = hub.read("f/", "f0", told.append)
    assert len(client.armed) == 2
    hub.stop(first)  # the lost one's id is dead: nothing to cancel
    assert client.cancelled == []
    hub.stop(again)
    assert client.cancelled == [2]


class LostAsASecondReaderJoins(SharedWatch):
    """Its stream ends just as a second reader is added: pyetcd's thread reads the
    readers before the new one is among them."""

    def __setattr__(self, name, value):
        if name == "readers" and len(value) == 2:
            object.__setattr__(self, "lost", True)
            for callback in self.readers.values():
                callback(None)
        object.__setattr__(self, name, value)


def test_a_reader_that_joins_as_the_watch_is_lost_is_told(monkeypatch):
    monkeypatch.setattr(changes, "SharedWatch", LostAsASecondReaderJoins)
    hub = SharedWatches(RecordingClient())
    first, second = [], []
    hub.read("f/", "f0", first.append)
    hub.read("f/", "f0", second.append)
    assert first == [None] and second == [None]
