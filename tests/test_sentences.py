import pytest
from transformer_jax import sentences

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
