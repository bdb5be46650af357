"""Form the group from the launcher's environment and pass a token around the ring."""

import numpy as np

import ringcomm as rc

with rc.init_process_group() as pg:
    right, left = (pg.rank + 1) % pg.world_size, (pg.rank - 1) % pg.world_size
    buf = np.zeros(4, dtype=np.int64)
    if pg.rank == 0:
        buf[:] = 100
        pg.send(buf, right)
        pg.recv(buf, left)
    else:
        pg.recv(buf, left)
        buf += pg.rank
        pg.send(buf, right)
    print(f"ring {pg.rank}/{pg.world_size} {int(buf[0])}")
