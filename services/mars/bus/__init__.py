"""Turn events over Kafka (aiokafka), by what each part does:

- `codec`: the event type on each topic, a record's checks (envelope, key, wire types, seal, text size),
  and how failures are classed (the event's fault, or trouble that passes);
- `topics`: the stage topics, created where missing;
- `producer`: keyed, traced, sealed publishing, and dead letters;
- `consumer`: stage consumer groups and broadcast readers (fetching, ordering per user, commits);
- `delivery`: one record's way through its handler, with attempts, timing and dead-lettering;
- `offsets`: what may be committed per partition, and the lag;
- `output`: a stage's one output event per turn.

The modules are imported by name (`from mars.bus.producer import EventProducer`): nothing is re-exported here.
"""
