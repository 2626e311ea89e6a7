import words
assert words.count('') == 0
