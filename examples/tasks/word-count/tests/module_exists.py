import os
assert os.path.isfile('words.py')
