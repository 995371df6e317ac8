"""`make report`: one HTML page over the outputs of every stage (it may import any stage; none imports it)."""
