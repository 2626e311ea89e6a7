import words
assert words.count('a b  c\n') == 3
