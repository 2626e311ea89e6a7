assert open('hi.txt', 'rb').read().strip() == b'hello'
