import calc
