from services.gateway.stop_strings import StopStrings


def feed_all(stops, pieces):
    s = StopStrings(stops)
    out = [s.feed(p) for p in pieces]
    return out, s


def test_text_that_may_begin_a_stop_string_is_held_back():
    out, s = feed_all(["STOP"], ["hello S", "T", "x"])
    assert out == ["hello ", "", "STx"]
    assert not s.stopped


def test_stop_string_across_pieces_ends_output_before_it():
    out, s = feed_all(["STOP"], ["hello S", "TO", "P and more"])
    assert out == ["hello ", "", ""]
    assert s.stopped and s.feed("later") == "" and s.flush() == ""


def test_earliest_of_several_stop_strings_wins():
    out, s = feed_all(["world", "lo w"], ["hello world"])
    assert out == ["hel"] and s.stopped


def test_flush_releases_held_text_when_generation_ends():
    s = StopStrings(["</end>"])
    assert s.feed("answer </e") == "answer "
    assert s.flush() == "</e"


def test_no_stop_strings_passes_text_through():
    out, s = feed_all([], ["a", "b"])
    assert out == ["a", "b"] and s.flush() == ""
