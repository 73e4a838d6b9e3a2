"""Incremental detokenization and stop sequences, with the default model's tokenizer."""
import pytest

from specmesh_services.common.text import TextStream


def stream_all(tokenizer, text, stop=()):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, stop)
    pieces = []
    for token in ids:
        stopped = stream.push(token)
        pieces.append(stream.take())
        if stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


@pytest.mark.parametrize("text", ["Hello world", "naïve café — 你好, emoji 🎉 ok", "  spaced\n\nlines"])
def test_streamed_pieces_join_to_the_decoded_text(tokenizer, text):
    pieces, stream = stream_all(tokenizer, text)
    assert "".join(pieces) == tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids)
    assert not any("\ufffd" in p for p in pieces)


def test_output_ends_before_the_stop_sequence(tokenizer):
    pieces, stream = stream_all(tokenizer, "The answer is 42. END of text", stop=["END"])
    assert "".join(pieces) == "The answer is 42. "
    assert stream.stopped


def test_text_that_may_begin_a_stop_sequence_is_held_back(tokenizer):
    stream = TextStream(tokenizer, ["###"])
    for token in tokenizer("abc #", add_special_tokens=False).input_ids:
        stream.push(token)
    assert stream.take() == "abc "  # " #" could be the start of "###"... only "#" is held
    assert stream.finish() == "#"


def test_special_tokens_are_not_in_the_text(tokenizer):
    stream = TextStream(tokenizer)
    stream.push(tokenizer.eos_token_id)
    assert stream.finish() == ""


@pytest.mark.parametrize("text", ["Hello world", "naïve café — 你好, emoji 🎉 ok", "  spaced\n\nlines"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_a_step_of_tokens_at_once_streams_what_token_by_token_does(tokenizer, text, chunk):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    stream = TextStream(tokenizer)
    pieces = []
    for at in range(0, len(ids), chunk):
        stream.extend(ids[at:at + chunk])
        pieces.append(stream.take())
    pieces.append(stream.finish())
    assert "".join(pieces) == "".join(stream_all(tokenizer, text)[0])
    assert not any("\ufffd" in p for p in pieces)
    with pytest.raises(RuntimeError, match="one by one"):
        TextStream(tokenizer, ["END"]).extend(ids)
