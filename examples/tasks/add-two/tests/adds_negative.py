import calc
assert calc.add(-1, 1) == 0
