import os
assert not os.path.exists('answer.txt')
