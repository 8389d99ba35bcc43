import pytest
from transformer_jax.decoding import sentences

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


def test_sentences_split_at_sentence_ends_not_at_abbreviations():
  text = 'Mr. Smith paid $3.50 at 5 p.m. today. He said "Hi!" Did he leave? Yes.'
  assert sentences.sentences(text, "en") == ['Mr. Smith paid $3.50 at 5 p.m. today.',
                                           'He said "Hi!"', "Did he leave?", "Yes."]
  assert sentences.sentences("no sentence end here", "en") == ["no sentence end here"]
  # French rules for a French source; a language pysbd lacks falls back to English rules.
  assert sentences.sentences("M. Dupont est là. Il part.", "fr") == ["M. Dupont est là.",
                                                                    "Il part."]
  assert sentences.sentences("One. Two.", "src") == ["One.", "Two."]


def test_only_lines_over_the_threshold_are_split_and_joined_back_in_order():
  lines = ["Short one. Two.", "A long line. With three. Sentences!", "", "Last. Line."]
  lengths = [4, 9, 1, 5]
  pieces, owners = sentences.split_long(lines, lengths, over=4, lang="en")
  assert pieces == ["Short one. Two.", "A long line.", "With three.", "Sentences!", "", "Last.",
                    "Line."]
  assert owners == [0, 1, 1, 1, 2, 3, 3]
  assert sentences.split_long(lines, lengths, over=None, lang="en") == (lines, [0, 1, 2, 3])
  translated = [p.upper() for p in pieces]
  assert sentences.join(translated, owners, len(lines)) == [
      "SHORT ONE. TWO.", "A LONG LINE. WITH THREE. SENTENCES!", "", "LAST. LINE."]


def test_a_text_that_is_one_sentence_skips_pysbd_with_pysbd_s_answer(monkeypatch):
  """Words joined by spaces, commas, quotes and dashes, closed by one mark, are one sentence
  without asking pysbd; anything else (a stop inside, an ellipsis, a closing quote after the
  stop, another script's mark) still goes to pysbd, whose answers are kept as they are."""
  one = ["  According to Tom, the \u201cword\u201d is - well - fine.  ", "Is it l'heure, Marie?",
         "Das ist gut!", "no mark at all"]
  other = {"Wait... What now": ["Wait...", "What now"], 'He left."': ["He left.", '"'],
           "Mr. Smith left": ["Mr. Smith left"], "One: two": ["One: two"],
           "\u4f60\u597d\u3002\u518d\u89c1": ["\u4f60\u597d\u3002", "\u518d\u89c1"],
           "Tom is ill... ": ["Tom is ill..", "."]}
  asked = []
  segment = sentences._segmenter("en").segment
  monkeypatch.setattr(sentences, "_segmenter", lambda lang: type(
      "Asked", (), {"segment": staticmethod(lambda t: asked.append(t) or segment(t))}))
  assert [sentences.sentences(t, "en") for t in one] == [[t.strip()] for t in one]
  assert asked == []
  assert {t: sentences.sentences(t, "en") for t in other} == other
  assert asked == list(other)


def _words(text: str) -> int:
  """A stand-in tokenizer: a token a word and one for <eos>; a word of over 6 letters is a
  token for every 6."""
  return sum(-(-len(w) // 6) for w in text.split()) + 1


def test_a_sentence_over_the_limit_is_cut_at_clauses_then_words_and_nothing_is_lost():
  text = "When the rain came, we ran home; the dog - wet and happy - followed us all the way there."
  pieces = sentences.fit(text, _words, limit=10)  # Clauses packed while they fit.
  assert pieces == ["When the rain came, we ran home; the dog", "- wet and happy",
                    "- followed us all the way there."]
  assert all(_words(p) <= 10 for p in pieces) and " ".join(pieces) == text
  # A clause that does not fit alone ("- followed ...": 9 tokens) is cut between words.
  assert sentences.fit(text, _words, limit=8) == [
      "When the rain came, we ran home;", "the dog - wet and happy", "- followed us all the way",
      "there."]
  # No clause cut in sight: runs of words; a word longer than the limit: runs of letters.
  assert sentences.fit("a b c d e f g", _words, limit=4) == ["a b c", "d e f", "g"]
  long = "x" * 40
  assert sentences.fit(f"go {long} now", _words, limit=3) == ["go", "x" * 12, "x" * 12,
                                                                "x" * 12, "xxxx", "now"]
  assert sentences.fit("Short.", _words, limit=3) == ["Short."]


def test_split_long_cuts_only_what_the_model_cannot_read():
  lines = ["One. Two three four five six seven.", "Short.", "a b c d e f g h i j"]
  count = lambda texts: [_words(t) for t in texts]
  lengths = count(lines)
  pieces, owners = sentences.split_long(lines, lengths, over=None, lang="en", limit=5,
                                        count=count)
  assert pieces == ["One. Two three four", "five six seven.", "Short.", "a b c d", "e f g h",
                    "i j"]
  assert owners == [0, 0, 1, 2, 2, 2]
  # With sentence splitting first, the sentences that fit are kept whole.
  pieces, _ = sentences.split_long(lines, lengths, over=3, lang="en", limit=5, count=count)
  assert pieces[:3] == ["One.", "Two three four five", "six seven."]
