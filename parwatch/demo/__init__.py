"""`parwatch demo`: a watched TP+PP run on this machine, wired together and explained."""
