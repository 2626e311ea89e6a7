assert 0 < len(open('answer.txt', 'rb').read().strip()) <= 8
