data = open('answer.txt', 'rb').read().strip().rstrip(b'.')
assert data and data.isdigit()
