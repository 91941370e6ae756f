"""After a crash: recovery of every claimed task, and gc of decided tasks' job directories."""
