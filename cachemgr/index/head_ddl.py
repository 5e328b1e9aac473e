"""The DDL of a fresh SQLite index at head, made from the models by `python -m
cachemgr.index.schema` (do not edit: run that after changing the models and adding their
migration). tests/test_schema.py holds it equal to the models and to the migrations."""

HEAD_DDL = (
    (
        "CREATE TABLE caches (\n"
        "\tid INTEGER NOT NULL, \n"
        "\thost VARCHAR(255) NOT NULL, \n"
        "\troot VARCHAR(1024) NOT NULL, \n"
        "\tlast_scan FLOAT, \n"
        "\tlast_eviction FLOAT, \n"
        "\tgds_clock FLOAT DEFAULT '0' NOT NULL, \n"
        "\tgds_history JSON, \n"
        "\treader INTEGER DEFAULT '0' NOT NULL, \n"
        "\tCONSTRAINT pk_caches PRIMARY KEY (id), \n"
        "\tCONSTRAINT uq_caches_host UNIQUE (host, root)\n"
        ")"
    ),
    (
        "CREATE TABLE component_sets (\n"
        "\tid INTEGER NOT NULL, \n"
        "\tdigest VARCHAR(32) NOT NULL, \n"
        "\tpart VARCHAR(16) NOT NULL, \n"
        "\tCONSTRAINT pk_component_sets PRIMARY KEY (id), \n"
        "\tCONSTRAINT uq_component_sets_digest UNIQUE (digest)\n"
        ")"
    ),
    (
        "CREATE TABLE fingerprints (\n"
        "\tkind VARCHAR(16) NOT NULL, \n"
        "\thash VARCHAR(64) NOT NULL, \n"
        "\thost VARCHAR(255) NOT NULL, \n"
        "\tname VARCHAR(255) NOT NULL, \n"
        "\tfirst_seen FLOAT NOT NULL, \n"
        "\tlast_seen FLOAT NOT NULL, \n"
        "\tCONSTRAINT pk_fingerprints PRIMARY KEY (kind, hash, host)\n"
        ")"
    ),
    (
        "CREATE TABLE parsed_content (\n"
        "\tname VARCHAR(64) NOT NULL, \n"
        "\tbytes BIGINT NOT NULL, \n"
        "\tkind VARCHAR(16) NOT NULL, \n"
        '\t"row" JSON NOT NULL, \n'
        "\trefs JSON NOT NULL, \n"
        "\tparts JSON NOT NULL, \n"
        "\tparsed_at FLOAT NOT NULL, \n"
        "\treader INTEGER DEFAULT '0' NOT NULL, \n"
        "\tCONSTRAINT pk_parsed_content PRIMARY KEY (name, bytes)\n"
        ")"
    ),
    (
        "CREATE TABLE shapes (\n"
        "\tid INTEGER NOT NULL, \n"
        "\tmodel VARCHAR(255) NOT NULL, \n"
        "\tsignature_hash VARCHAR(16) NOT NULL, \n"
        "\tsignature TEXT NOT NULL, \n"
        "\tspec TEXT NOT NULL, \n"
        "\toptions TEXT NOT NULL, \n"
        "\thost VARCHAR(255), \n"
        "\tcount BIGINT NOT NULL, \n"
        "\tfirst_seen FLOAT NOT NULL, \n"
        "\tlast_seen FLOAT NOT NULL, \n"
        "\tCONSTRAINT pk_shapes PRIMARY KEY (id), \n"
        "\tCONSTRAINT uq_shapes_model UNIQUE (model, signature_hash)\n"
        ")"
    ),
    (
        "CREATE TABLE component_set_items (\n"
        "\tset_id INTEGER NOT NULL, \n"
        "\tname VARCHAR(255) NOT NULL, \n"
        "\thash VARCHAR(64) NOT NULL, \n"
        "\tvalue TEXT NOT NULL, \n"
        "\tCONSTRAINT pk_component_set_items PRIMARY KEY (set_id, name), \n"
        "\tCONSTRAINT fk_component_set_items_set_id_component_sets FOREIGN KEY(set_id) REFERENCES component_sets (id) ON DELETE CASCADE\n"
        ")"
    ),
    (
        "CREATE TABLE dirs (\n"
        "\tcache_id INTEGER NOT NULL, \n"
        "\tpath VARCHAR(1024) NOT NULL, \n"
        "\tmtime_ns BIGINT NOT NULL, \n"
        "\tCONSTRAINT pk_dirs PRIMARY KEY (cache_id, path), \n"
        "\tCONSTRAINT fk_dirs_cache_id_caches FOREIGN KEY(cache_id) REFERENCES caches (id) ON DELETE CASCADE\n"
        ")"
    ),
    (
        "CREATE TABLE entries (\n"
        "\tid INTEGER NOT NULL, \n"
        "\tcache_id INTEGER NOT NULL, \n"
        '\t"key" VARCHAR(1024) NOT NULL, \n'
        "\tdir VARCHAR(1024) DEFAULT '' NOT NULL, \n"
        "\tkind VARCHAR(16) NOT NULL, \n"
        "\tref VARCHAR(128), \n"
        "\talias VARCHAR(64), \n"
        "\tbytes BIGINT NOT NULL, \n"
        "\tfiles INTEGER NOT NULL, \n"
        "\tmtime FLOAT NOT NULL, \n"
        "\tfirst_seen FLOAT NOT NULL, \n"
        "\tlast_access FLOAT NOT NULL, \n"
        "\thit_count INTEGER NOT NULL, \n"
        "\tgraph_key VARCHAR(64), \n"
        "\tsignature TEXT, \n"
        "\tsignature_hash VARCHAR(16), \n"
        "\toptions_hash VARCHAR(16), \n"
        "\tguards TEXT, \n"
        "\tdevice_types VARCHAR(64), \n"
        "\tcompile_seconds FLOAT, \n"
        "\ttorch_version VARCHAR(64), \n"
        "\ttorch_version_hash VARCHAR(64), \n"
        "\tsystem_hash VARCHAR(64), \n"
        "\tcorrupt TEXT, \n"
        "\tparse_state SMALLINT DEFAULT '0' NOT NULL, \n"
        "\tunrecorded TEXT, \n"
        "\tcontent VARCHAR(64), \n"
        "\tCONSTRAINT pk_entries PRIMARY KEY (id), \n"
        '\tCONSTRAINT uq_entries_cache_id UNIQUE (cache_id, "key"), \n'
        "\tCONSTRAINT fk_entries_cache_id_caches FOREIGN KEY(cache_id) REFERENCES caches (id) ON DELETE CASCADE\n"
        ")"
    ),
    ("CREATE INDEX ix_entries_cache_alias ON entries (cache_id, alias) WHERE alias IS NOT NULL"),
    ("CREATE INDEX ix_entries_cache_dir ON entries (cache_id, dir)"),
    ("CREATE INDEX ix_entries_cache_graph ON entries (cache_id, graph_key) WHERE graph_key IS NOT NULL"),
    ("CREATE INDEX ix_entries_cache_parse ON entries (cache_id, parse_state)"),
    ("CREATE INDEX ix_entries_cache_ref ON entries (cache_id, ref)"),
    ("CREATE INDEX ix_entries_content ON entries (content) WHERE content IS NOT NULL"),
    ("CREATE INDEX ix_entries_corrupt ON entries (cache_id) WHERE corrupt IS NOT NULL"),
    ("CREATE INDEX ix_entries_usage ON entries (cache_id, kind, bytes, files, mtime)"),
    (
        "CREATE TABLE events (\n"
        "\tid INTEGER NOT NULL, \n"
        "\tcache_id INTEGER NOT NULL, \n"
        "\tts FLOAT NOT NULL, \n"
        "\tkind VARCHAR(16) NOT NULL, \n"
        "\tentry_kind VARCHAR(16), \n"
        "\tentry_key VARCHAR(1024), \n"
        "\tgraph_key VARCHAR(64), \n"
        "\trecompile BOOLEAN NOT NULL, \n"
        "\tbytes BIGINT, \n"
        "\tseconds FLOAT, \n"
        "\tCONSTRAINT pk_events PRIMARY KEY (id), \n"
        "\tCONSTRAINT fk_events_cache_id_caches FOREIGN KEY(cache_id) REFERENCES caches (id) ON DELETE CASCADE\n"
        ")"
    ),
    ("CREATE INDEX ix_events_cache_ts ON events (cache_id, ts)"),
    (
        "CREATE TABLE pins (\n"
        "\tid INTEGER NOT NULL, \n"
        "\tcache_id INTEGER NOT NULL, \n"
        '\t"key" VARCHAR(1024) NOT NULL, \n'
        "\treason TEXT, \n"
        "\tcreated FLOAT NOT NULL, \n"
        "\tCONSTRAINT pk_pins PRIMARY KEY (id), \n"
        '\tCONSTRAINT uq_pins_cache_id UNIQUE (cache_id, "key"), \n'
        "\tCONSTRAINT fk_pins_cache_id_caches FOREIGN KEY(cache_id) REFERENCES caches (id) ON DELETE CASCADE\n"
        ")"
    ),
    (
        "CREATE TABLE entry_component_sets (\n"
        "\tentry_id INTEGER NOT NULL, \n"
        "\tpart VARCHAR(16) NOT NULL, \n"
        "\tset_id INTEGER NOT NULL, \n"
        "\tCONSTRAINT pk_entry_component_sets PRIMARY KEY (entry_id, part), \n"
        "\tCONSTRAINT fk_entry_component_sets_entry_id_entries FOREIGN KEY(entry_id) REFERENCES entries (id) ON DELETE CASCADE, \n"
        "\tCONSTRAINT fk_entry_component_sets_set_id_component_sets FOREIGN KEY(set_id) REFERENCES component_sets (id) ON DELETE CASCADE\n"
        ")"
    ),
    ("CREATE INDEX ix_entry_component_sets_set_id ON entry_component_sets (set_id)"),
    (
        "CREATE TABLE entry_refs (\n"
        "\tid INTEGER NOT NULL, \n"
        "\tentry_id INTEGER NOT NULL, \n"
        "\tkind VARCHAR(16) NOT NULL, \n"
        "\tref VARCHAR(128) NOT NULL, \n"
        "\tCONSTRAINT pk_entry_refs PRIMARY KEY (id), \n"
        "\tCONSTRAINT fk_entry_refs_entry_id_entries FOREIGN KEY(entry_id) REFERENCES entries (id) ON DELETE CASCADE\n"
        ")"
    ),
    ("CREATE INDEX ix_entry_refs_entry_id ON entry_refs (entry_id)"),
    ("CREATE INDEX ix_entry_refs_kind_ref ON entry_refs (kind, ref)"),
    (
        "CREATE VIEW entry_components AS SELECT ecs.entry_id AS entry_id, ecs.part AS part, i.name AS name, i.hash AS hash, i.value AS value FROM entry_component_sets ecs JOIN component_set_items i ON i.set_id = ecs.set_id"
    ),
)
