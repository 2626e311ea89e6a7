assert len(open('answer.txt', 'rb').read().split()) == 1
