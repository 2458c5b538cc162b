"""Input kinds: one room per kind of input a model reads (text today).

A kind owns what is particular to it, for every task that reads it:
- reading a request's items off the wire and checking each (`read_*`: a 400 naming the item);
- its limits (for text: characters before tokenizing, tokens per input after);
- its preparation into model inputs (for text: the tokenizer, a batch's texts in one call);
- what a pass of it costs the planner: a kind's model input is a sequence of positions the
  encoder computes (`ModelInput`, model/inputs.py), and the planner prices a pass by its padded
  positions (`len(ModelInput)`, scheduling/planner.py), tokens for text.

The tasks (tasks/) decide what comes out of the model; the route families (routes/) say where in
a body the items are. Neither reads an item of a kind but through its room.
"""
