# rules for the data stages
