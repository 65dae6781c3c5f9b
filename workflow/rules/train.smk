# rules for the train stages
