import os
assert os.path.isfile('hi.txt')
