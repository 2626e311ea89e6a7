assert b'5' in open('answer.txt', 'rb').read()
