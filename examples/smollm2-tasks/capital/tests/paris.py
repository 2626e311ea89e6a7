assert b'paris' in open('answer.txt', 'rb').read().lower()
